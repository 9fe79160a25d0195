"""The model engine's side of kvcore's API in a fuzz run: every call the engine makes to ``CacheScheduler``
and ``BlockWorker`` the way ``docs/engine-api.md`` says an engine does, the ops in flight, and the checks
of every answer against what the engine knows (the byte checks are ``KVChecks``)."""

from __future__ import annotations

import random
from collections.abc import Callable

from kvcore.execution.worker import BlockWorker
from kvcore.ids import RequestId
from kvcore.keying.hashing import ExtraKeys
from kvcore.model.step import WRITE_BACK_SESSION, BlockOp, OpReport
from kvcore.ports import Direction
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore_cli.fuzz.checks import KVChecks
from kvcore_cli.fuzz.faulty_ports import FaultyPorts
from kvcore_cli.fuzz.memory import EngineMemory
from kvcore_cli.fuzz.requests import BLOCK_TOKENS, Request, RequestBook, State
from kvcore_cli.fuzz.results import FuzzSummary
from kvcore_cli.fuzz.trace import Trace

__all__ = ["Connector"]

WAIT_S = 5.0  # what the engine passes to ``wait``; the fuzzer's queues decide without waiting on it


class Connector:
    """The calls, each noted in the trace. ``rng`` is the engine's: whether it gives up a late load is
    its decision. ``window``: the model's sliding window, in blocks (0: none)."""

    def __init__(
        self,
        sched: CacheScheduler,
        worker: BlockWorker,
        ports: FaultyPorts,
        memory: EngineMemory,
        book: RequestBook,
        checks: KVChecks,
        trace: Trace,
        summary: FuzzSummary,
        rng: random.Random,
        recompute_late: bool,
        window: int = 0,
    ) -> None:
        self._sched = sched
        self._worker = worker
        self._ports = ports
        self._memory = memory
        self._book = book
        self._checks = checks
        self._trace = trace
        self._summary = summary
        self._rng = rng
        self._recompute_late = recompute_late
        self._window = window
        memory.on_take = self._fence_readers
        self.on_save: Callable[[Request], None] = lambda req: None  # called with each request saved
        self.ops: dict[int, BlockOp] = {}  # handed to the worker, not reported yet
        self._fenced: set[int] = set()  # ops of a preempted admission: their blocks are no longer its own
        self._ending: dict[RequestId, Request] = {}  # ended with "delay": may still have a save planned

    def flush(self) -> None:
        """Resume a halted worker (as vLLM's worker side asks each step), ``execute(take_plan())``, await
        this plan's loads, hand every report to ``complete``, then take load errors and finished
        requests; settle loads that are fully reported; check."""
        self._worker.resume()
        plan = self._sched.take_plan()
        for op in plan.ops:
            self._trace.note(_describe(op))
            self._planned(op)
            self.ops[op.op_id] = op
        self._worker.execute(plan)
        loads = plan.op_ids(Direction.LOAD)
        reports = self._worker.wait(loads, WAIT_S) if loads else self._worker.reports()
        refused = self._ports.mover.refused if self._ports.mover is not None else []
        if refused:
            self._trace.fail(None, f"the mover refused a copy kvcore planned: {refused[0]}")
        for report in reports:
            self._reported(report)
        self._sched.complete(reports)
        self._take_load_errors()
        late = dict.fromkeys(self.ops[op].request_id for op in loads if op in self.ops)
        for rid in late:
            self._late_load(self._book.live[RequestId(rid)])
        for rid in self._sched.take_finished():
            self._trace.note(f"take_finished -> {rid}")
            self._named_finished(rid)
        for rid in list(self._book.running):
            req = self._book.live[rid]
            if req.state is State.LOADING and not req.load_ops:
                self._settle(req)
        self._checks.engine_memory()
        self._check_counts()

    def lookup(self, req: Request, local: int) -> int | None:
        """Tokens kvcore offers beyond the ``local`` ones the engine holds; ``None`` while pending."""
        rid = req.rid
        if req.chat.by_hashes:
            full = req.hashes[: len(req.tokens) // BLOCK_TOKENS]
            hits = self._sched.lookup(
                rid,
                block_hashes=full,
                hash_block_tokens=BLOCK_TOKENS,
                num_tokens=len(req.tokens),
                local_tokens=local,
                extra=ExtraKeys(cache_salt=req.chat.salt),
            )
            self._trace.note(
                f"lookup {rid} block_hashes[{len(full)}] of {len(req.tokens)} local={local} -> {hits}"
            )
        else:
            hits = self._sched.lookup(
                rid, tokens=req.tokens, local_tokens=local, extra=ExtraKeys(cache_salt=req.chat.salt)
            )
            self._trace.note(
                f"lookup {rid} tokens[{len(req.tokens)}] salt={req.chat.salt} local={local} -> {hits}"
            )
        req.looked_up = True
        if hits is None:
            return None
        self._summary.lookups += 1
        self._summary.hash_lookups += req.chat.by_hashes
        if hits < 0 or hits % BLOCK_TOKENS or local + hits >= len(req.tokens):
            self._trace.fail(
                rid, f"lookup offered {hits} tokens beyond {local} of a {len(req.tokens)}-token prompt"
            )
        return hits

    def start_load(self, req: Request, local: int, hits: int) -> None:
        """Load the ``hits`` tokens the lookup offered after the engine's own ``local`` blocks; the request
        does not run until every op of the load is reported."""
        queued = self._sched.start_load(req.rid, req.blocks)
        self._trace.note(f"start_load {req.rid} e{req.blocks} -> {queued}")
        if queued < 0 or queued % BLOCK_TOKENS or queued > hits:
            self._trace.fail(req.rid, f"start_load queued {queued} tokens of the {hits} lookup offered")
        req.state = State.LOADING
        req.promised = range(local, local + hits // BLOCK_TOKENS)
        self._summary.window_loads += bool(req.promised) and req.blocks[local] is None
        req.queued = queued // BLOCK_TOKENS
        req.errors, req.load_ops = set(), set()

    def save(self, req: Request, *, final: bool = False) -> None:
        if req.chat.by_hashes:
            saved = self._sched.save(
                req.rid,
                req.blocks,
                num_tokens=req.computed,
                block_hashes=req.hashes,
                hash_block_tokens=BLOCK_TOKENS,
                final=final,
            )
        else:
            saved = self._sched.save(
                req.rid, req.blocks, num_tokens=req.computed, tokens=req.tokens, final=final
            )
        self._trace.note(f"save {req.rid} e{req.blocks} num_tokens={req.computed} final={final} -> {saved}")
        self._summary.saved_chunks += saved
        self._checks.handed_to_save(req)
        self.on_save(req)

    def end(self, req: Request, *, finish: bool) -> None:
        """Finish or abort; "delay" keeps the blocks until ``take_finished`` names the request."""
        rid = req.rid
        delay = self._sched.finish(rid) if finish else self._sched.abort(rid)
        verb = "finish" if finish else "abort"
        self._trace.note(f"{verb} {rid} ({req.state.value}) -> {delay}")
        busy = self._ops_of(rid)
        if busy and not delay:
            self._trace.fail(
                rid,
                f"{verb} said its blocks are free while {busy[0].direction.value} {busy[0].op_id} "
                "is in flight",
            )
        self._book.remove(req)
        if delay:
            self._book.ended[rid] = req.blocks
            self._ending[rid] = req
        else:
            self._memory.release(req.blocks)
        if finish:
            self._summary.finished += 1
        else:
            self._summary.aborted += 1

    def preempt(self, req: Request) -> None:
        """Preempt (load errors taken first, as the contract asks): its blocks are freed at once, first in
        line for the next allocation; its copies in flight are fenced by the next plan."""
        self._take_load_errors()
        self._sched.preempt(req.rid)
        self._trace.note(f"preempt {req.rid} ({req.state.value}) e{req.blocks}")
        self._memory.release(req.blocks, front=True)
        self._fenced.update(op for op, o in self.ops.items() if o.request_id == req.rid)
        self._book.requeue(req)
        self._summary.preemptions += 1

    def reset(self) -> None:
        """``reset`` once every request holding blocks is preempted; what was handed to save before is of
        the old epoch."""
        self._sched.reset()
        self._trace.note("reset")
        self._checks.new_epoch()

    def check_released(self) -> None:
        """At quiescence nothing may be left held, by kvcore or the engine."""
        stats = self._sched.stats()
        pool = stats.pool
        left = {
            "requests": stats.requests,
            "ops in flight": stats.ops_in_flight,
            "pinned": pool.pinned,
            "storing": pool.storing,
            "slots neither free nor ready": pool.used - pool.ready,
            "engine blocks in use": self._memory.in_use(),
        }
        index = self._ports.index
        if index is not None:
            left["remote locks neither handed over nor released"] = len(index.open) + index.untaken
            left["remote locks ended twice"] = len(index.ended_twice)
        leaks = {k: v for k, v in left.items() if v}
        if leaks:
            self._trace.fail(None, f"at quiescence the scheduler still holds {leaks}")

    def _planned(self, op: BlockOp) -> None:
        """A load writes only blocks its request's load covers; a save reads only blocks it computed; a
        write-back touches no engine block (its bytes are checked when a load brings them back)."""
        if op.write_back:
            if op.engine_blocks or op.host_blocks or op.request_id != WRITE_BACK_SESSION or not op.remote:
                self._trace.fail(None, f"write-back {op.op_id} is malformed: {op}")
            return
        req = self._book.live.get(RequestId(op.request_id))
        if op.direction is Direction.LOAD:
            if req is None or req.state is not State.LOADING:
                self._trace.fail(op.request_id, f"load {op.op_id} planned for a request that is not loading")
            allowed = {b for j in req.promised if (b := req.blocks[j]) is not None}
            what = "outside the blocks its lookup offered"
            req.load_ops.add(op.op_id)
        else:
            # a save queued as its request finished (its last tail) is planned once it has ended
            req = req or self._ending.get(RequestId(op.request_id))
            if req is None or req.state is not State.RUNNING:
                self._trace.fail(op.request_id, f"save {op.op_id} planned for a request that is not running")
            allowed = {b for b in req.blocks[: req.computed // BLOCK_TOKENS] if b is not None}
            what = "that the request has not computed"
            self._checks.save_planned(op, allowed)
        stray = [b for b in op.engine_blocks if b not in allowed]
        if stray:
            self._trace.fail(
                op.request_id, f"{op.direction.value} {op.op_id} touches engine blocks {stray} {what}"
            )

    def _reported(self, report: OpReport) -> None:
        op = self.ops.pop(report.op_id, None)
        self._fenced.discard(report.op_id)
        failed = f" failed {list(report.failed)}" if report.failed else ""
        self._trace.note(f"report #{report.op_id}{failed}{' ' + report.error if report.error else ''}")
        if op is None:
            self._trace.fail(None, f"the worker reported op {report.op_id}, which is not in flight")
        req = self._book.live.get(RequestId(op.request_id))
        if req is not None:
            req.load_ops.discard(op.op_id)
        self._checks.reported(op, report)

    def _take_load_errors(self) -> None:
        for rid, blocks in self._sched.take_load_errors().items():
            self._trace.note(f"take_load_errors {rid}: {list(blocks)}")
            req = self._book.live.get(rid)
            if req is None or req.gave_up:
                continue  # ended, or already recomputing the whole load
            if req.state is not State.LOADING:
                self._trace.fail(
                    rid, f"take_load_errors named blocks {list(blocks)} after its load was settled"
                )
            req.errors.update(blocks)

    def _late_load(self, req: Request) -> None:
        """A load not reported after the wait: the engine either holds the request back until it is, or
        (rule 4 of the contract) gives it up: it fences the load (``worker.fence``: nothing writes the
        blocks any more) and recomputes the blocks now."""
        recompute = self._rng.random() < 0.5 and self._recompute_late
        self._trace.note(
            f"load of {req.rid} late: {'fence it and recompute now' if recompute else 'hold the request'}"
        )
        if not recompute:
            return
        self._worker.fence(sorted(req.load_ops))
        if not self._can_recompute(req, req.promised.start):
            self._trace.note(f"{req.rid}: its window before the load was given back: preempt it")
            self.preempt(req)
            self._summary.loads_given_up += 1
            return
        req.gave_up = True
        req.state = State.RUNNING
        req.computed = req.promised.start * BLOCK_TOKENS
        self._summary.loads_given_up += 1

    def _settle(self, req: Request) -> None:
        """A load whose ops are all reported: every block the lookup offered either loaded the request's
        own bytes or was reported for recompute; the engine recomputes from the first reported block."""
        mine = {block: j for j in req.promised if (block := req.blocks[j]) is not None}
        stray = sorted(req.errors - mine.keys())
        if stray:
            self._trace.fail(
                req.rid, f"take_load_errors named engine blocks {stray}, outside its load {req.promised}"
            )
        unreported = [
            b
            for b in req.blocks[req.promised.start + req.queued : req.promised.stop]
            if b is not None and b not in req.errors
        ]
        if unreported:
            self._trace.fail(
                req.rid,
                f"start_load queued {req.queued} of the {len(req.promised)} blocks lookup offered, but "
                f"take_load_errors never named engine blocks {unreported}",
            )
        bad = sorted(mine[b] for b in req.errors)
        for j in req.promised:
            if req.blocks[j] not in req.errors and req.blocks[j] is not None:
                self._checks.loaded(req, j)
        stop = bad[0] if bad else req.promised.stop
        served = (stop - req.promised.start) * BLOCK_TOKENS
        extra = self._sched.extra_cached_tokens(req.rid)
        if extra != served:
            self._trace.fail(
                req.rid, f"extra_cached_tokens says {extra}, but {served} tokens loaded before a failure"
            )
        self._summary.loads_checked += 1
        self._summary.blocks_verified += len(mine) - len(bad)
        self._summary.blocks_recomputed += len(bad)
        if not self._can_recompute(req, stop):
            self._trace.note(f"{req.rid}: block {stop} failed, its window was given back: preempt it")
            self.preempt(req)
            return
        for j in range(req.promised.start, stop):
            if req.blocks[j] is not None:
                self._memory.record(req, j, (j + 1) * BLOCK_TOKENS)
        req.computed = stop * BLOCK_TOKENS
        req.state = State.RUNNING

    def _can_recompute(self, req: Request, first: int) -> bool:
        """Whether the engine can compute the request's tokens from block ``first`` on: it holds every
        block of the window those tokens see (with a sliding window, it may have given them back)."""
        return None not in req.blocks[max(first - self._window, 0) : first + 1]

    def _fence_readers(self, block: int) -> None:
        """An engine block is handed out again: a save still reading it (its request gave it back, out
        of a sliding window) must keep nothing."""
        readers = sorted(
            i for i, op in self.ops.items() if op.direction is Direction.SAVE and block in op.engine_blocks
        )
        if readers:
            self._trace.note(f"engine block {block} handed out again: fence saves {readers}")
            self._worker.fence(readers)
            self._summary.saves_fenced += len(readers)

    def _named_finished(self, rid: RequestId) -> None:
        """``take_finished`` named an ended request: its blocks are the engine's again."""
        blocks = self._book.ended.pop(rid, None)
        self._ending.pop(rid, None)
        if blocks is None:
            self._trace.fail(
                rid, "take_finished named a request whose end was not delayed, or named it twice"
            )
        busy = [op.op_id for op in self._ops_of(rid)]
        if busy:
            self._trace.fail(rid, f"take_finished named it while its ops {busy} are in flight")
        self._memory.release(blocks)

    def _ops_of(self, rid: str) -> list[BlockOp]:
        """The request's ops in flight on its current blocks (not fenced by a preemption)."""
        return [op for i, op in self.ops.items() if op.request_id == rid and i not in self._fenced]

    def _check_counts(self) -> None:
        stats = self._sched.stats()
        if stats.ops_in_flight != len(self.ops):
            self._trace.fail(
                None, f"the scheduler counts {stats.ops_in_flight} ops in flight, the worker {len(self.ops)}"
            )
        known = self._book.tracked()
        if stats.requests != known:
            self._trace.fail(
                None, f"the scheduler tracks {stats.requests} requests, the engine expects {known}"
            )
        pool = stats.pool
        if not pool.ready + pool.storing <= pool.used <= pool.capacity:
            self._trace.fail(None, f"pool usage is inconsistent: {pool}")


def _describe(op: BlockOp) -> str:
    remote = f" remote{[c.keys[0][-8:] if c.keys[0] else None for c in op.remote]}" if op.remote else ""
    blocks = f"e{list(op.engine_blocks)} h{list(op.host_blocks)}"
    return f"{op.direction.value}#{op.op_id} {op.request_id} {blocks}{remote}"
