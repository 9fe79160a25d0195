"""The worker side for any engine: executes the scheduler's block ops through a ``BlockMover``.

Workers own memory and execute; they decide nothing (DESIGN §3). Every op becomes one mover job, and every
op is reported exactly once — a copy the mover refused is reported as failed at once, so the scheduler
never waits for an op that will not come.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from kvcore.errors import TransferTimeout, UsageError
from kvcore.ids import JobId
from kvcore.jobs import JobResult
from kvcore.plan import OpReport, StepPlan
from kvcore.ports import BlockMover, BlockTransfer

__all__ = ["BlockWorker"]

log = logging.getLogger(__name__)


class BlockWorker:
    """One rank's executor of ``StepPlan``s."""

    def __init__(self, mover: BlockMover, rank: int = 0) -> None:
        self._mover = mover
        self._rank = rank
        self._ops: dict[JobId, tuple[int, int]] = {}  # job -> (op id, number of blocks)
        self._jobs: dict[int, JobId] = {}
        self._refused: list[OpReport] = []

    def execute(self, plan: StepPlan) -> None:
        """Submit every op of the plan; returns at once."""
        for op in plan.ops:
            try:
                job = self._mover.submit(BlockTransfer(op.direction, op.engine_blocks, op.host_blocks))
            except UsageError as exc:
                log.warning("kvcore: op %d refused by the mover: %s", op.op_id, exc)
                failed = tuple(range(len(op.engine_blocks)))
                self._refused.append(OpReport(op.op_id, self._rank, failed, str(exc)))
                continue
            self._ops[job] = (op.op_id, len(op.engine_blocks))
            self._jobs[op.op_id] = job

    def reports(self) -> tuple[OpReport, ...]:
        """Ops finished since the last call (never blocks)."""
        return self._report(self._mover.poll())

    def wait(self, op_ids: Collection[int], timeout: float) -> tuple[OpReport, ...]:
        """Block until the given ops finished (e.g. a synchronous load before the forward pass).

        Returns every report that is ready, the awaited ones included. On timeout the unfinished ops are
        simply absent: they stay in flight (a copy may still touch their blocks, so their host slots stay
        reserved) and are reported by a later call; the caller treats their blocks as not loaded.
        """
        jobs = [self._jobs[o] for o in op_ids if o in self._jobs]
        try:
            results = self._mover.wait(jobs, timeout)
        except TransferTimeout as exc:
            log.warning("kvcore: %s", exc)
            results = ()
        return self._report(results + self._mover.poll())

    def _report(self, results: tuple[JobResult, ...]) -> tuple[OpReport, ...]:
        out, self._refused = self._refused, []
        for result in results:
            entry = self._ops.pop(result.job_id, None)
            if entry is None:
                continue  # not one of this worker's jobs
            op_id, n = entry
            del self._jobs[op_id]
            failed = result.failed if result.error is None else tuple(range(n))
            out.append(OpReport(op_id, self._rank, failed, result.error))
        return tuple(out)
