"""The connector's worker side (one per rank): executes the step's copies on kvcore's CPU tier.

Synchronous loads run in ``start_load_kv``, which vLLM calls before the forward pass whenever a request
of the step has a synchronous hit. On a CPU engine they are awaited there (bounded by
``transfer_timeout_s``). On a CUDA engine the forward pass waits for their copies on the GPU instead
(``BlockWorker.order_loads``: the engine's stream waits on each copy's event): the host queues the
forward pass at once, and takes the loads' results after it, at the first of ``wait_for_save``,
``get_finished`` and ``get_block_ids_with_load_errors`` — before any save of the step is decided, and in
time for vLLM to recompute a failed load's blocks (it discards the step's output for that request). Only
loads still fetching from a remote tier are awaited on the host first.
Asynchronous loads (the step's ``receiving`` requests) start there too and are awaited by nobody:
``get_finished`` names a request in ``finished_recving`` once its loads are reported, their failed blocks
in the same step (``get_block_ids_with_load_errors``). One not done within ``transfer_timeout_s`` is
abandoned and its blocks reported failed: a fetch still running is never copied into vLLM's blocks, so
the request is named at once; one whose copy into vLLM's blocks runs is named when that copy ends (vLLM
keeps the request's blocks until then, so no late copy writes blocks that hold other KV), and halts the
tier's copies (``BlockWorker.halt``) should it run another ``transfer_timeout_s``; they resume once it
has ended (``build_worker_meta`` asks every step and tells the scheduler side).

Saves are submitted in ``wait_for_save``, after the forward pass wrote the blocks, and never block the
step. Saves of blocks vLLM evicted in this step (lazy store policy) run in ``handle_preemptions``, which
vLLM calls before the forward pass and the loads, and are awaited there: the new owner of the block
overwrites it next. A finished request whose saves are in flight, or still to be submitted by
``wait_for_save`` (vLLM calls it after ``get_finished`` with speculative decoding), is reported in
``get_finished`` only when this rank's copies of it are done; a preempted request's saves are fenced
before vLLM reuses its blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from kvcore.config import KVCoreConfig
from kvcore.errors import InvalidSpecError
from kvcore.execution.worker import BlockWorker
from kvcore.kit.faults import FaultHooks
from kvcore.model.engine import EngineSpec
from kvcore.model.step import BlockOp, OpReport, StepPlan
from kvcore.plugins.compose import open_worker
from kvcore.ports import Direction
from kvcore_vllm.kv_layout import connector_views
from kvcore_vllm.metadata import KVCoreMetadata, KVCoreWorkerMetadata
from kvcore_vllm.rank_agreement import RankAgreement, alone

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)


class WorkerSide:
    """``opener`` opens the rank's worker over its KV tensors (default: ``kvcore.plugins.compose.open_worker``
    with this side's config, engine, rank and ``faults``); a test gives a worker over memory it controls.
    ``agree`` tells which of a step's synchronous loads failed on any rank (``rank_agreement``; one
    rank: its own), so that no rank saves what a step computed over another rank's failed load."""

    def __init__(
        self,
        config: KVCoreConfig,
        engine: EngineSpec,
        layers: list[str],
        rank: int,
        opener: Callable[[Sequence[torch.Tensor]], BlockWorker] | None = None,
        *,
        faults: FaultHooks | None = None,
        agree: RankAgreement = alone,
    ) -> None:
        self._agree = agree
        self._opener = opener or (
            lambda tensors: open_worker(config, engine, tensors, rank=rank, faults=faults)
        )
        self._rank = rank
        self._engine = engine
        self._halt_told = False  # the scheduler side knows this rank's copies were halted
        self._layers = layers
        self._timeout = config.transfer_timeout_s
        self._worker: BlockWorker | None = None
        self._inflight: dict[int, BlockOp] = {}
        self._reports: list[OpReport] = []
        self._load_errors: set[int] = set()
        self._delayed: set[str] = set()
        # requests with saves in the bound step that wait_for_save has not submitted yet: with speculative
        # decoding vLLM asks for finished requests before it (``defer_finalize``)
        self._unsubmitted: set[str] = set()
        self._abandoned: set[int] = set()  # ops waited on past their deadline: reported as failed
        self._unloaded: set[str] = set()  # requests whose load failed in this step, before its saves
        # the step's synchronous loads until their results are taken: (loads, reports so far, the loads
        # the forward pass waits for on the device)
        self._settling: tuple[list[BlockOp], list[OpReport], set[int]] | None = None
        # asynchronous loads: request id -> (deadline, its load ops), until named in finished_recving
        self._receiving: dict[str, tuple[float, tuple[int, ...]]] = {}
        self._writing: set[int] = set()  # abandoned asynchronous loads whose copy into vLLM's blocks may run
        self._failed_loads: set[str] = set()  # asynchronous loads that failed, any cause, until reported
        self.last_load: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # for out-of-band checks

    @property
    def worker(self) -> BlockWorker:
        if self._worker is None:
            raise InvalidSpecError("register_kv_caches has not been called")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker = self._opener(connector_views(kv_caches, self._layers, self._engine))

    def start_load_kv(self, meta: KVCoreMetadata) -> None:
        self._settle_loads()  # a step that ended with neither wait_for_save nor get_finished
        self._load_errors.update(meta.failed_blocks)
        self._delayed.update(meta.delayed)
        self._unsubmitted = {op.request_id for op in meta.plan.ops if op.direction is Direction.SAVE}
        every = self._run(meta.plan, Direction.LOAD)
        if every:
            last = every[-1]
            self.last_load = (last.engine_blocks, last.host_blocks)
        receiving = set(meta.receiving)
        deadline = time.monotonic() + self._timeout
        for rid in meta.receiving:
            self._receiving[rid] = (deadline, tuple(op.op_id for op in every if op.request_id == rid))
        self._failed_loads.update(rid for rid in meta.failed_requests if rid in self._receiving)
        loads = [op for op in every if op.request_id not in receiving]
        if not loads:
            return
        ids = [op.op_id for op in loads]
        ordered = self.worker.order_loads(ids)
        now = [i for i in ids if i not in ordered]
        reports = list(self.worker.wait(now, self._timeout)) if now else []
        self._collect(reports)
        self._settling = (loads, reports, ordered)
        # Every rank settles at the same call (``agree`` is collective): where loads are ordered on the
        # device, always after the forward pass, even in a step whose copies all ended already.
        if not self.worker.orders_loads_on_device:
            self._settle_loads()

    def _settle_loads(self) -> None:
        """Take the results of the step's synchronous loads (those the forward pass waited for on the
        device are awaited now, bounded by ``transfer_timeout_s``): which requests' loads failed on any
        rank (their saves of the step are dropped), and which blocks vLLM recomputes."""
        if self._settling is None:
            return
        loads, reports, ordered = self._settling
        self._settling = None
        waiting = [i for i in ordered if i in self._inflight]
        if waiting:
            more = self.worker.wait(waiting, self._timeout)
            self._collect(more)
            reports.extend(more)
        done = {r.op_id for r in reports}
        late = [op for op in loads if op.op_id not in done]
        failed = {r.op_id for r in reports if r.failed}
        unloaded = {op.request_id for op in loads if op.op_id in failed or op.op_id not in done}
        self._unloaded = self._agree(list(dict.fromkeys(op.request_id for op in loads)), unloaded)
        if late:
            # vLLM recomputes these blocks in this very step: no copy may write them from now on. A
            # fetch still running is not copied; a copy into them still running is waited for and,
            # should it hang, halts the tier's copies until it ends (``BlockWorker.fence``)
            log.warning("kvcore: %d loads not done after %.1fs; recomputing them", len(late), self._timeout)
            self._abandon(late)
            for op in late:
                self._load_errors.update(op.engine_blocks)

    def wait_for_save(self, meta: KVCoreMetadata) -> None:
        """Start the step's saves, but none of a request whose load failed in this step: vLLM computed
        its blocks from that load's on over KV that is not the request's (and recomputes them), so what
        those saves would read is wrong. They are reported failed at once; the request's next saves
        store its recomputed blocks."""
        self._settle_loads()
        unloaded, self._unloaded = self._unloaded, set()
        saves: list[BlockOp] = []
        for op in meta.plan.ops:
            if op.direction is Direction.SAVE and op.request_id in unloaded:
                failed = tuple(range(len(op.engine_blocks)))
                self._reports.append(
                    OpReport(op.op_id, self._rank, failed, "its request's load failed", True)
                )
            elif op.direction is Direction.SAVE:
                saves.append(op)
        self._run(StepPlan(tuple(saves)), Direction.SAVE)
        self._unsubmitted = set()

    def handle_preemptions(self, meta: KVCoreMetadata) -> None:
        self._settle_loads()  # before any wait here collects their reports
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
        reused = set(meta.reused)
        if reused:  # sliding-window blocks freed from a request's window and handed out again
            fenced += [
                op
                for op in self._inflight.values()
                if op.direction is Direction.SAVE
                and op.op_id not in fenced_ids
                and reused.intersection(op.engine_blocks)
            ]
        if fenced and self._worker is not None:
            # copies of preempted requests that finish in time keep what they moved
            self._collect(self._worker.wait([op.op_id for op in fenced], self._timeout))
            # one still running now reads blocks vLLM is about to reuse: its chunks must not be kept
            self._abandon([op for op in fenced if op.op_id in self._inflight])

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose copies are done (``finished_sending``: none with a save of the bound
        step still to submit, since vLLM frees the blocks it names), and requests whose asynchronous loads
        are (``finished_recving``)."""
        self._settle_loads()
        if self._worker is not None:
            self._collect(self._worker.reports())
        busy = {op.request_id for op in self._inflight.values()} | self._unsubmitted
        done = {rid for rid in self._delayed if rid not in busy}
        self._delayed -= done
        return done or None, self._received() or None

    def _received(self) -> set[str]:
        """Requests whose asynchronous loads can no longer write their blocks: every load reported, or
        abandoned at its deadline with no copy into vLLM's blocks running (a fetch into a host slot may
        go on; its slot stays reserved until it ends). A copy that still runs past twice the deadline
        halts the tier's copies, which ends it."""
        now = time.monotonic()
        received: set[str] = set()
        for rid, (deadline, op_ids) in list(self._receiving.items()):
            running = [i for i in op_ids if i in self._inflight]
            if now >= deadline and not self._abandoned.issuperset(running):
                log.warning("kvcore: the load of %s not done after %.1fs; recomputing it", rid, self._timeout)
                self._abandoned.update(running)
                self._writing.update(self.worker.abandon(running))
                self._failed_loads.add(rid)
                for i in running:
                    if i not in self._writing:  # its blocks are safe now: vLLM may recompute them
                        self._load_errors.update(self._inflight[i].engine_blocks)
            writing = [i for i in running if i in self._writing]
            if not running or (now >= deadline and not writing):
                received.add(rid)
                del self._receiving[rid]
            elif now >= deadline + self._timeout and self._worker is not None:
                log.error(
                    "kvcore: the load of %s still copies %.1fs past its deadline; halting the tier's copies",
                    rid,
                    self._timeout,
                )
                self._worker.halt()
                self._receiving[rid] = (float("inf"), op_ids)
        return received

    def take_failed_loads(self, received: Iterable[str]) -> set[str]:
        """Which of the ``received`` requests (just named by ``get_finished``) had a load fail, any cause:
        for engines told of failures by request (vLLM's ``failed_recving``)."""
        failed = self._failed_loads.intersection(received)
        self._failed_loads -= failed
        self._failed_loads &= self._receiving.keys()  # the rest were reported before: nothing to tell
        return failed

    def take_load_errors(self) -> set[int]:
        self._settle_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> KVCoreWorkerMetadata | None:
        """The step's reports, and whether this rank's copies are halted: told with every report while
        they are, and once when they resume (asked here, every step, after a halt)."""
        halted = self._worker is not None and not self._worker.resume()
        if not self._reports and halted == self._halt_told:
            return None
        reports, self._reports = tuple(self._reports), []
        resumed = self._halt_told and not halted
        self._halt_told = halted
        rank = (self._rank,)
        return KVCoreWorkerMetadata(reports, rank if halted else (), rank if resumed else ())

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
            self._writing.discard(report.op_id)
            if op is not None and report.op_id in self._abandoned:
                self._abandoned.discard(report.op_id)
                report = OpReport(report.op_id, report.rank, tuple(range(len(op.engine_blocks))), "abandoned")
                # its blocks were reported when they were given back (a late synchronous load, a fenced
                # one), unless it is an asynchronous load whose request waits for this very report
                awaited = op.op_id in self._receiving.get(op.request_id, (0.0, ()))[1]
            else:
                awaited = op is not None and op.direction is Direction.LOAD
            if awaited and op is not None and report.failed:
                self._load_errors.update(op.engine_blocks[i] for i in report.failed)
                if op.request_id in self._receiving:
                    self._failed_loads.add(op.request_id)
            self._reports.append(report)
