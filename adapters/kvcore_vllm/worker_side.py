"""The connector's worker side (one per rank): executes the step's copies on kvcore's CPU tier.

Loads run in ``start_load_kv``, which vLLM calls before the forward pass whenever a request of the step
has a synchronous hit, and are awaited there (bounded by ``transfer_timeout_s``); saves are submitted in
``wait_for_save``, after the forward pass wrote the blocks, and never block the step. Saves of blocks
vLLM evicted in this step (lazy store policy) run in ``handle_preemptions``, which vLLM calls before the
forward pass and the loads, and are awaited there: the new owner of the block overwrites it next. A
finished request whose saves are in flight is reported in ``get_finished`` only when this rank's copies
of it are done; a preempted request's saves are fenced before vLLM reuses its blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from kvcore.compose import open_worker
from kvcore.config import KVCoreConfig
from kvcore.engine import EngineSpec
from kvcore.errors import InvalidSpecError
from kvcore.plan import BlockOp, OpReport, StepPlan
from kvcore.ports import Direction
from kvcore.worker import BlockWorker
from kvcore_vllm.metadata import KVCoreMetadata, KVCoreWorkerMetadata

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, config: KVCoreConfig, engine: EngineSpec, layers: list[str], rank: int) -> None:
        self._config = config
        self._engine = engine
        self._layers = layers
        self._rank = rank
        self._timeout = config.transfer_timeout_s
        self._worker: BlockWorker | None = None
        self._inflight: dict[int, BlockOp] = {}
        self._reports: list[OpReport] = []
        self._load_errors: set[int] = set()
        self._delayed: set[str] = set()
        self._abandoned: set[int] = set()  # ops waited on past their deadline: reported as failed
        self.last_load: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # for out-of-band checks

    @property
    def worker(self) -> BlockWorker:
        if self._worker is None:
            raise InvalidSpecError("register_kv_caches has not been called")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self._layers if name not in kv_caches]
        if missing:
            raise InvalidSpecError(f"KV caches missing for layers {missing}")
        tensors = [kv_caches[name] for name in self._layers]
        self._worker = open_worker(self._config, self._engine, tensors, rank=self._rank)

    def start_load_kv(self, meta: KVCoreMetadata) -> None:
        self._load_errors.update(meta.failed_blocks)
        self._delayed.update(meta.delayed)
        loads = self._run(meta.plan, Direction.LOAD)
        if not loads:
            return
        reports = self.worker.wait([op.op_id for op in loads], self._timeout)
        self._collect(reports)
        done = {r.op_id for r in reports}
        late = [op for op in loads if op.op_id not in done]
        if late:
            # vLLM will recompute these blocks in this very step: no copy may still be writing them.
            # Stop the copies (joining their threads) and treat this tier as dead from now on.
            log.error("kvcore: %d loads not done after %.1fs; closing the tier", len(late), self._timeout)
            self.worker.halt()
            self._abandon(late)
            for op in late:
                self._load_errors.update(op.engine_blocks)
        last = loads[-1]
        self.last_load = (last.engine_blocks, last.host_blocks)

    def wait_for_save(self, meta: KVCoreMetadata) -> None:
        self._run(meta.plan, Direction.SAVE)

    def handle_preemptions(self, meta: KVCoreMetadata) -> None:
        evicting = self._run(meta.evictions, Direction.SAVE)
        if evicting:
            self._collect(self.worker.wait([op.op_id for op in evicting], self._timeout))
            late = [op for op in evicting if op.op_id in self._inflight]
            if late:
                # the forward pass overwrites these blocks now: what a late copy reads is not their KV
                log.warning("kvcore: %d saves of evicted blocks not done in time; dropped", len(late))
                self._abandon(late)
        fenced_ids = (*meta.plan.fenced, *meta.evictions.fenced)
        fenced = [self._inflight[i] for i in fenced_ids if i in self._inflight]
        if fenced and self._worker is not None:
            # copies of preempted requests that finish in time keep what they moved
            self._collect(self._worker.wait([op.op_id for op in fenced], self._timeout))
            # one still running now reads blocks vLLM is about to reuse: its chunks must not be kept
            self._abandon([op for op in fenced if op.op_id in self._inflight])

    def get_finished(self) -> set[str] | None:
        if self._worker is not None:
            self._collect(self._worker.reports())
        busy = {op.request_id for op in self._inflight.values()}
        done = {rid for rid in self._delayed if rid not in busy}
        self._delayed -= done
        return done or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> KVCoreWorkerMetadata | None:
        if not self._reports:
            return None
        reports, self._reports = tuple(self._reports), []
        return KVCoreWorkerMetadata(reports)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def _run(self, plan: StepPlan, direction: Direction) -> list[BlockOp]:
        ops = [op for op in plan.ops if op.direction is direction]
        if ops:
            self._inflight.update((op.op_id, op) for op in ops)
            self.worker.execute(StepPlan(tuple(ops)))
        return ops

    def _abandon(self, ops: Iterable[BlockOp]) -> None:
        ids = [op.op_id for op in ops]
        self._abandoned.update(ids)
        if self._worker is not None:
            self._worker.fence(ids)  # their blocks are vLLM's again: late copies keep nothing

    def _collect(self, reports: Iterable[OpReport]) -> None:
        for report in reports:
            op = self._inflight.pop(report.op_id, None)
            if report.op_id in self._abandoned and op is not None:
                self._abandoned.discard(report.op_id)
                report = OpReport(report.op_id, report.rank, tuple(range(len(op.engine_blocks))), "abandoned")
            elif op is not None and op.direction is Direction.LOAD and report.failed:
                self._load_errors.update(op.engine_blocks[i] for i in report.failed)
            self._reports.append(report)
