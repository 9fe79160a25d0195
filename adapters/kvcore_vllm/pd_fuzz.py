"""``kvcore fuzz --pd`` (``python -m kvcore_vllm.pd_fuzz``): a seeded lifecycle fuzz of P/D beside the
tiers, against vLLM's side of the connector contract.

The combined scheduler side (``PDTiersScheduler``: a real ``SchedulerSide`` over a CPU pool and a real
``PDScheduler`` of a ``kv_both`` engine) and the combined worker side (``PDTiersWorker``) run under a
model of vLLM 0.32's scheduler, for a model of one KV-cache group or (``window``) a hybrid one: a
sliding-window group and a full attention group (the real ``GroupedSchedulerSide`` and
``GroupedWorkerSide``, vLLM's null block before a window, failures told by request). Requests of shared
prefixes arrive, some as decode requests with a producer's params (with a window, a few whose producer did
not stop one token short of the prompt or gave back more of its window than this engine did), some as
prefill requests for another engine, some plain; vLLM asks for their hits (from a local prefix hit of its
own), allocates (or fails to, and asks again), waits for asynchronous loads, runs, preempts, finishes and
aborts them at every point. The two worker halves are stand-ins that do what the real ones do with their
metadata, late by a seeded number of steps, and fail some of it: the tier half reports each op and names a
request received (sent) when all its loads (saves) are reported; the P/D half names a pull received and an
offer sent. The bytes are not this fuzzer's: ``kvcore fuzz`` checks the tiers', ``tests/mooncake`` the
pulls' through real engines.

What vLLM asserts or needs is checked at every step: a request named in ``finished_recving`` is one it
waits for (waiting for remote KV, or finished while waiting: then freed), never a running one; one named
in ``finished_sending`` is one it kept for the connector; neither twice; a request named failed (several
groups) is one named received in the same report, and one whose tier load or pull failed is named failed;
and at the end every request was freed, the tier's trackers and copies are gone and every P/D pull and
offer was answered. ``kvcore fuzz --pd --seed S --steps N [--window W]`` replays a run (the CLI runs this
module in a process of its own, as ``kvcore bench`` runs a benchmark: adapters import no other adapter).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import sys
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any, cast

import attrs
from attrs import frozen
from vllm.v1.request import RequestStatus

from kvcore.config import PDConfig
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.step import OpReport
from kvcore.ports import Direction
from kvcore_vllm.grouped_scheduler import GroupedSchedulerSide
from kvcore_vllm.grouped_worker import GroupedWorkerSide
from kvcore_vllm.metadata import KVCoreWorkerMetadata
from kvcore_vllm.pd_metadata import PDTiersMetadata
from kvcore_vllm.pd_params import RemotePrefill
from kvcore_vllm.pd_scheduler import PDRole, PDScheduler
from kvcore_vllm.pd_tiers_scheduler import PDTiersScheduler
from kvcore_vllm.pd_tiers_worker import PDTiersWorker
from kvcore_vllm.scheduler_side import NULL_BLOCK, SchedulerSide
from kvcore_vllm.settings import read_extra_config

__all__ = [
    "BLOCK",
    "ENGINE",
    "PDFuzzFailure",
    "PDFuzzSummary",
    "main",
    "run_pd_fuzz",
    "scheduler_output",
    "vllm_request",
]

BLOCK = 128  # vLLM's CPU block size
ENGINE = EngineSpec(
    "tiny@default",
    "bfloat16",
    num_layers=2,
    total_kv_heads=2,
    layout=KVLayout(
        LayoutKind.VLLM_CPU, num_blocks=64, block_tokens=BLOCK, num_kv_heads=2, head_size=32, dtype_size=2
    ),
)
"""The engine the fuzz models: a tiny one of vLLM's CPU layout, few blocks (they are reused at once)."""

_DRAIN_STEPS = 200
_IDENTITY = "vllm/sha256/fuzz"


def vllm_request(rid: str, hashes: list[bytes], num_tokens: int, params: dict[str, Any] | None = None) -> Any:
    """A stand-in for vLLM's ``Request``: the attributes kvcore's adapter reads and writes, a waiting prompt
    of ``num_tokens`` tokens (``num_tokens`` is an attribute here: set it after a change of the tokens)."""
    prompt = list(range(num_tokens))
    return SimpleNamespace(
        request_id=rid,
        block_hashes=list(hashes),
        prompt_token_ids=prompt,
        prompt_embeds=None,
        prompt_is_token_ids=None,
        _all_token_ids=list(prompt),
        num_tokens=num_tokens,
        num_prompt_tokens=num_tokens,
        num_computed_tokens=0,
        num_output_placeholders=0,
        max_tokens=16,
        kv_transfer_params=params,
        status=RequestStatus.WAITING,
        get_skip_reading_prefix_cache=lambda: False,
    )


def scheduler_output(new: Iterable[tuple[str, list[int] | tuple[list[int], ...], int, int]] = ()) -> Any:
    """A stand-in for vLLM's ``SchedulerOutput``: the ``new`` requests scheduled (id, block table or one
    per KV-cache group, computed tokens, scheduled tokens)."""
    new = list(new)
    reqs = [
        SimpleNamespace(
            req_id=rid,
            block_ids=blocks if isinstance(blocks, tuple) else (blocks,),
            num_computed_tokens=computed,
        )
        for rid, blocks, computed, _ in new
    ]
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={rid: scheduled for rid, _, _, scheduled in new},
        preempted_req_ids=None,
    )


class PDFuzzFailure(Exception):
    """A check failed: the seed, the step, the request, what differed, and the line that replays it."""

    def __init__(self, seed: int, step: int, request: str | None, detail: str, replay: str) -> None:
        self.seed, self.step, self.request, self.detail, self.replay = seed, step, request, detail, replay
        about = f" ({request})" if request else ""
        super().__init__(
            f"kvcore fuzz --pd: check failed at step {step}, seed {seed}{about}: {detail}\n  replay: {replay}"
        )


def _hashes(n: int, seed: str) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


@frozen
class PDFuzzSummary:
    """What a run did: requests by kind and end, pulls and their failures, tier loads."""

    seed: int
    steps: int
    window: int
    requests: int
    decodes: int
    prefills: int
    pulls: int
    failed_pulls: int
    failed_loads: int
    preemptions: int
    aborted: int

    def brief(self) -> str:
        return (
            f"seed {self.seed}: OK, {self.requests} requests ({self.decodes} P/D decodes), "
            f"{self.pulls} pulls ({self.failed_pulls} failed), {self.failed_loads} tier loads failed, "
            f"{self.preemptions} preemptions, {self.aborted} aborted"
        )

    def render(self) -> str:
        model = f"hybrid (a window of {self.window} blocks)" if self.window else "one KV-cache group"
        rows = [
            ("seed / steps", f"{self.seed} / {self.steps}"),
            ("model", model),
            (
                "requests",
                f"{self.requests} ({self.decodes} decodes of a producer's prompt, {self.prefills} "
                f"prefills for a decode engine; {self.preemptions} preemptions, {self.aborted} aborted)",
            ),
            ("pulls", f"{self.pulls} ({self.failed_pulls} failed)"),
            ("tier loads failed", f"{self.failed_loads}"),
            (
                "verification",
                "OK: every report as vLLM needs it, every request freed, every transfer answered",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(["", "kvcore fuzz --pd summary", *(f"  {k:<{width}}  {v}" for k, v in rows)])


class _Late:
    """Reports handed out a seeded number of steps after they were made."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._due: list[tuple[int, Any]] = []
        self.step = 0

    def later(self, item: Any, most: int = 3) -> None:
        self._due.append((self.step + self._rng.randint(0, most), item))

    def take(self) -> list[Any]:
        now = [item for due, item in self._due if due <= self.step]
        self._due = [(due, item) for due, item in self._due if due > self.step]
        return now

    def __len__(self) -> int:
        return len(self._due)


class _TierHalf:
    """The tiers' worker side of one group as its metadata makes it act: every op reported (some failed),
    a request received once all its loads of that step are reported, sent once its saves are."""

    def __init__(
        self, rng: random.Random, late: _Late, failures: set[str], fail_rate: float, group: int = 0
    ) -> None:
        self._rng, self._late, self._group, self._failures = rng, late, group, failures
        self._fail_rate = fail_rate
        self._failing: set[str] = set()  # requests with a failed load, until named received
        self.failed_loads = 0
        self.reports: list[OpReport] = []
        self._open: dict[int, str] = {}  # op id -> request, loads and saves not reported yet
        self._receiving: dict[str, set[int]] = {}
        self._delayed: set[str] = set()
        self._sent: set[str] = set()
        self._received: set[str] = set()

    def start_load_kv(self, meta: Any) -> None:
        for op in (*meta.plan.ops, *meta.evictions.ops):
            self._open[op.op_id] = op.request_id
            failed = tuple(range(len(op.engine_blocks))) if self._rng.random() < self._fail_rate else ()
            if failed and op.direction is Direction.LOAD:
                self._failing.add(op.request_id)
                self._failures.add(op.request_id)
                self.failed_loads += 1
            self._late.later(("tier-op", self._group, OpReport(op.op_id, 0, failed)))
        for rid in meta.receiving:
            loads = (op for op in meta.plan.ops if op.request_id == rid and op.direction is Direction.LOAD)
            self._receiving[rid] = {op.op_id for op in loads}
        self._delayed.update(meta.delayed)

    def report(self, report: OpReport) -> None:
        self._open.pop(report.op_id, None)
        self.reports.append(report)

    def take_failed_loads(self, received: Iterable[str]) -> set[str]:
        failed = self._failing.intersection(received)
        self._failing -= failed
        return failed

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        for rid, loads in list(self._receiving.items()):
            if not loads.intersection(self._open):
                del self._receiving[rid]
                self._received.add(rid)
        busy = set(self._open.values())
        for rid in list(self._delayed):
            if rid not in busy:
                self._delayed.discard(rid)
                self._sent.add(rid)
        sent, received = self._sent, self._received
        self._sent, self._received = set(), set()
        return sent or None, received or None

    def take_load_errors(self) -> set[int]:
        return set()

    def build_worker_meta(self) -> Any:

        reports, self.reports = tuple(self.reports), []
        return KVCoreWorkerMetadata(reports) if reports else None


class _PDHalf:
    """The P/D worker side: a pull received (maybe failed), an offer freed, each late."""

    def __init__(self, rng: random.Random, late: _Late, failures: set[str], fail_rate: float) -> None:
        self._rng, self._late, self._failures, self._fail_rate = rng, late, failures, fail_rate
        self.errors: set[int] = set()
        self._failed: set[str] = set()
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self.unanswered: set[str] = set()  # transfer ids offered or pulled, not answered yet
        self.pulls = 0
        self.failed_pulls = 0

    def start_load_kv(self, meta: Any) -> None:
        for offer in meta.offers:
            self.unanswered.add(offer.transfer_id)
            self._late.later(("pd-sent", offer.request_id, offer.transfer_id), most=5)
        for receive in meta.receives:
            if receive.is_release:
                continue
            failing = self._rng.random() < self._fail_rate
            failed = (*receive.written, *receive.missing) if failing else receive.missing
            self.pulls += 1
            self.failed_pulls += bool(failed)
            self.unanswered.add(receive.transfer_id)
            self._late.later(("pd-received", receive.request_id, receive.transfer_id, failed), most=5)

    def answer(self, item: tuple[Any, ...]) -> None:
        kind, rid, transfer = item[:3]
        self.unanswered.discard(transfer)
        if kind == "pd-sent":
            self._sent.add(rid)
        else:
            self._received.add(rid)
            self.errors.update(item[3])
            if item[3]:
                self._failed.add(rid)
                self._failures.add(rid)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        sent, received = self._sent, self._received
        self._sent, self._received = set(), set()
        return sent or None, received or None

    def take_load_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def take_failed(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed


class _Vllm:
    """vLLM's scheduler, as far as a connector sees it: statuses, block tables, what it waits for."""

    def __init__(self, seed: int, steps: int, window: int, preempt: bool, faults: bool) -> None:

        self.seed, self.steps, self.window = seed, steps, window * BLOCK
        self.preempt, self.faults = preempt, faults
        self.rng = random.Random(seed)
        self.side = _scheduler_side(self.window)
        self.late = _Late(random.Random(seed + 1))
        self.failures: set[str] = set()  # requests whose tier load or pull failed, until named received
        groups = range(2 if window else 1)
        tier_rate, pull_rate = (0.1, 0.2) if faults else (0.0, 0.0)
        self.tiers = [
            _TierHalf(random.Random(seed + 2 + n), self.late, self.failures, tier_rate, n) for n in groups
        ]
        self.pd = _PDHalf(random.Random(seed + 5), self.late, self.failures, pull_rate)
        tiers = GroupedWorkerSide(cast(Any, self.tiers)) if window else self.tiers[0]
        self.worker = PDTiersWorker(cast(Any, tiers), cast(Any, self.pd))
        self.requests: dict[str, Any] = {}  # every request vLLM holds (not freed)
        self.blocks: dict[str, tuple[list[int], ...]] = {}  # a block table per KV-cache group
        self.kept: dict[str, str] = {}  # finished, blocks kept until "recving" or "sending" names them
        self.preempted: list[str] = []
        self.new: list[tuple[str, tuple[list[int], ...], int, int]] = []
        self.free = list(range(1, ENGINE.layout.num_blocks))  # vLLM's free blocks (0 is its null block)
        self.count = self.decodes = self.prefills = self.preemptions = self.aborted = 0
        self.step_now = 0

    def fail(self, rid: str | None, detail: str) -> PDFuzzFailure:
        replay = f"kvcore fuzz --pd --seed {self.seed} --steps {self.steps}"
        replay += f" --window {self.window // BLOCK}" if self.window else ""
        replay += "" if self.preempt else " --no-preempt"
        replay += "" if self.faults else " --no-faults"
        return PDFuzzFailure(self.seed, self.step_now, rid, detail, replay)

    def _skipped(self, tokens: int) -> int:
        """Blocks of the sliding-window group before the window of ``tokens`` computed tokens."""
        return max(tokens - self.window + 1, 0) // BLOCK

    def arrive(self) -> None:

        self.count += 1
        rid = f"r{self.count}"
        blocks = self.rng.randint(1, 6)
        tokens = blocks * BLOCK + self.rng.choice((0, 1, 60))
        hashes = _hashes(tokens // BLOCK, f"family-{self.rng.randint(0, 3)}")
        kind = self.rng.random()
        params: dict[str, Any] | None = None
        if kind < 0.5:
            # with a window the producer stopped one token short of the prompt (a few did not)
            computed = tokens - 1 if self.window and tokens > 1 and self.rng.random() < 0.9 else tokens
            producer = list(range(1000, 1000 + -(-computed // BLOCK)))
            tables = [producer]
            if self.window:  # the producer gave back its window's older blocks; a few gave back more
                gone = self._skipped(computed) + (1 if self.rng.random() < 0.1 else 0)
                tables = [[NULL_BLOCK] * gone + [b + 1000 for b in producer[gone:]], producer]
            source = RemotePrefill(f"t-{rid}", "prefill", ("tcp://127.0.0.1:5600",), tables, computed)
            params = source.to_params()
            self.decodes += 1
        elif kind < 0.7:
            params = {"do_remote_decode": True}
            self.prefills += 1
        request = vllm_request(rid, hashes, tokens, params)
        request.ready = False  # named in finished_recving, not scheduled yet
        self.side.pd.on_new_request(request)  # with a window, a prefill stops one token short
        request.num_tokens = len(request._all_token_ids)
        if params is not None and params.get("do_remote_decode") and self.window and tokens > 1:
            shortened = (tokens - 1, len(hashes[: (tokens - 1) // BLOCK]), 1)
            if (request.num_prompt_tokens, len(request.block_hashes), request.max_tokens) != shortened:
                raise self.fail(rid, f"a prefill of {tokens} tokens was not shortened to {shortened[0]}")
        self.requests[rid] = request

    def schedule(self) -> None:

        for rid, request in list(self.requests.items()):
            if rid in self.kept:
                continue
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS and request.ready:
                self._run(request)  # named received since the last step: scheduled now
            if request.status is not RequestStatus.WAITING:
                continue
            local = self.rng.randint(0, (request.num_tokens - 1) // BLOCK) * BLOCK
            hits, is_async = self.side.get_num_new_matched_tokens(request, local)
            needed = -(-request.num_tokens // BLOCK)
            if hits is None or needed * len(self.tiers) > len(self.free) or self.rng.random() < 0.1:
                continue  # a lookup still running, or no room: asked again next step
            if local + hits > request.num_tokens:
                raise self.fail(
                    rid, f"a hit of {hits} tokens past a local one of {local}: more than the prompt"
                )
            tables = tuple([self.free.pop() for _ in range(needed)] for _ in self.tiers)
            if self.window:  # vLLM holds none of the sliding-window group's blocks before its window
                skipped = self._skipped(local + hits)
                self.free.extend(tables[0][:skipped])
                tables[0][:skipped] = [NULL_BLOCK] * skipped
            self.blocks[rid] = tables
            allocated = SimpleNamespace(get_block_ids=lambda tables=tables: tables)
            self.side.update_state_after_alloc(request, cast(Any, allocated), hits)
            request.num_computed_tokens = local + hits
            if is_async and hits:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.ready = False
            else:
                self._run(request)

    def _run(self, request: Any) -> None:
        request.status = RequestStatus.RUNNING
        computed = min(request.num_computed_tokens, request.num_tokens - 1)
        rid = request.request_id
        self.new.append((rid, self.blocks[rid], computed, request.num_tokens - computed))
        request.num_computed_tokens = request.num_tokens

    def end_some(self) -> None:
        for rid, request in list(self.requests.items()):
            if rid in self.kept:
                continue
            roll = self.rng.random()
            waiting = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not request.ready
            if request.status is RequestStatus.RUNNING and roll < 0.05 and self.preempt:
                self._preempt(request)
            elif (request.status is RequestStatus.RUNNING and roll < 0.3) or roll > 0.97:
                self._finish(request, waiting)

    def _preempt(self, request: Any) -> None:
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self._give_back(self.blocks.pop(request.request_id))
        self.preempted.append(request.request_id)
        self.preemptions += 1

    def _finish(self, request: Any, waiting: bool) -> None:
        rid = request.request_id
        aborted = request.status is not RequestStatus.RUNNING or self.rng.random() < 0.3
        self.aborted += aborted
        request.status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
        delay, _ = self.side.request_finished(request, self.blocks.get(rid, tuple([] for _ in self.tiers)))
        if waiting:
            self.kept[rid] = "recving"  # vLLM's own rule: freed when its load is named received
        elif delay:
            self.kept[rid] = "sending"
        else:
            self._free(rid)

    def _free(self, rid: str) -> None:
        del self.requests[rid]
        self._give_back(self.blocks.pop(rid, ()))
        self.kept.pop(rid, None)

    def _give_back(self, tables: tuple[list[int], ...]) -> None:

        self.free.extend(block for table in tables for block in table if block != NULL_BLOCK)

    def step(self) -> None:

        out = scheduler_output(self.new)
        out.preempted_req_ids = set(self.preempted)
        self.new, self.preempted = [], []
        meta = self.side.build_connector_meta(out)
        self.worker.start_load_kv(PDTiersMetadata(meta.tiers, meta.pd))
        for item in self.late.take():
            if item[0] == "tier-op":
                self.tiers[item[1]].report(item[2])
            else:
                self.pd.answer(item)
        self.late.step += 1
        sent, received, failed = self.worker.transfer_results()
        if not failed <= received:
            raise self.fail(min(failed - received), "named failed, not received")
        if failed and not self.window:
            raise self.fail(min(failed), "named failed with one KV-cache group: failures are told by block")
        lost = (self.failures & received) - failed if self.window else set()
        if lost:
            raise self.fail(min(lost), "its load failed, and it was named received but not failed")
        self.failures -= received
        self.worker.take_load_errors()
        output = SimpleNamespace(
            kv_connector_worker_meta=self.worker.build_worker_meta(),
            finished_recving=received,
            finished_sending=sent,
        )
        self.side.update_connector_output(cast(Any, output))
        for rid in sorted(received):
            request = self.requests.get(rid)
            if request is None:
                raise self.fail(rid, "named received after vLLM freed it")
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request.ready:
                    raise self.fail(rid, "named received twice")
                request.ready = True
            elif self.kept.get(rid) == "recving":
                self._free(rid)
            else:
                raise self.fail(rid, f"named received while {request.status.name}")
        for rid in sorted(sent):
            if self.kept.get(rid) != "sending":
                raise self.fail(rid, "named sent, vLLM did not keep it for that")
            self._free(rid)
        self.step_now += 1

    def check_drained(self) -> None:
        if self.requests:
            kept = {rid: self.kept.get(rid) for rid in self.requests}
            raise self.fail(min(self.requests), f"never freed: {kept}")
        if self.pd.unanswered:
            raise self.fail(None, f"transfers never answered: {sorted(self.pd.unanswered)}")
        if self.side.tracked():
            raise self.fail(None, "the combined side kept a request that ended")
        stats = self.side.stats()
        if (stats.requests, stats.ops_in_flight, stats.pool.pinned) != (0, 0, 0):
            raise self.fail(
                None,
                f"the tiers kept {stats.requests} requests, {stats.ops_in_flight} ops, "
                f"{stats.pool.pinned} pinned slots",
            )


def _scheduler_side(window: int) -> Any:
    """The combined scheduler side of a ``kv_both`` engine: of one group, or (``window`` tokens) of a
    sliding-window group and a full attention group."""

    settings = read_extra_config({"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": BLOCK})
    config = PDConfig(port=5600)
    if not window:
        tiers = SchedulerSide(settings, ENGINE, BLOCK, _IDENTITY)
        return PDTiersScheduler(tiers, PDScheduler(PDRole.BOTH, "engine-0", BLOCK, 1, config))
    swa_engine = attrs.evolve(ENGINE, model_id="tiny#swa", window_tokens=window)
    swa = SchedulerSide(
        settings, swa_engine, BLOCK, _IDENTITY, group=0, window=window, failures_by_request=True
    )
    full_engine = attrs.evolve(ENGINE, model_id="tiny#full")
    full = SchedulerSide(settings, full_engine, BLOCK, _IDENTITY, group=1, failures_by_request=True)
    pd = PDScheduler(PDRole.BOTH, "engine-0", BLOCK, 1, config, groups=2, stops_short=True)
    return PDTiersScheduler(GroupedSchedulerSide([swa, full]), pd)


def run_pd_fuzz(
    seed: int, steps: int, *, window: int = 0, preempt: bool = True, faults: bool = True
) -> PDFuzzSummary:
    """One seeded run: ``steps`` steps of arrivals, then up to 200 without any until everything ended.
    ``window``: a hybrid model whose sliding window is that many blocks (0: one full attention group).
    Raises ``PDFuzzFailure`` (seed, step, request, what, a replay line) where a check fails."""
    vllm = _Vllm(seed, steps, window, preempt, faults)
    for _ in range(steps):
        if vllm.rng.random() < 0.6:
            vllm.arrive()
        vllm.schedule()
        vllm.end_some()
        vllm.step()
    for _ in range(_DRAIN_STEPS):  # no new requests: everything ends
        vllm.schedule()
        vllm.end_some()
        vllm.step()
        if not vllm.requests and not len(vllm.late):
            break
    vllm.check_drained()
    return PDFuzzSummary(
        seed=seed,
        steps=steps,
        window=window,
        requests=vllm.count,
        decodes=vllm.decodes,
        prefills=vllm.prefills,
        pulls=vllm.pd.pulls,
        failed_pulls=vllm.pd.failed_pulls,
        failed_loads=sum(half.failed_loads for half in vllm.tiers),
        preemptions=vllm.preemptions,
        aborted=vllm.aborted,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run seeds from ``--seed`` on; print each summary (one run: the whole of it), each failure to stderr.
    Returns 1 if a seed failed."""
    parser = argparse.ArgumentParser(prog="kvcore fuzz --pd", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--no-preempt", action="store_true")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="show kvcore's warnings")
    args = parser.parse_args(argv)
    if not args.verbose:  # the faults are injected on purpose: kvcore's warnings about them are expected
        for name in ("kvcore", "kvcore_vllm"):
            logging.getLogger(name).setLevel(logging.ERROR)
    if args.window < 0:
        print(
            f"kvcore fuzz: window: got {args.window}, expected a number of blocks >= 0 (0: none)",
            file=sys.stderr,
        )
        return 2
    failed = 0
    for seed in range(args.seed, args.seed + args.runs):
        try:
            summary = run_pd_fuzz(
                seed, args.steps, window=args.window, preempt=not args.no_preempt, faults=not args.no_faults
            )
        except PDFuzzFailure as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        print(summary.render() if args.runs == 1 else summary.brief())
    if args.runs > 1:
        print(f"{args.runs - failed} of {args.runs} seeds passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
