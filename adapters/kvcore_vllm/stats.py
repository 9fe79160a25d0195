"""Connector statistics: vLLM's ``KVConnectorStats`` for its log, and Prometheus metrics (``vllm:kvcore_*``).

The scheduler side reports, each step, the counters that moved since the previous step (lookups, hit
tokens, loaded and saved blocks, failures; the chunks each remote tier's lookups found, as
``tier_found_<n>``, tier 1 first) and the pool's current usage (gauges, named ``pool_*``). Aggregating
adds counters and keeps the latest gauges. Prometheus shows the per-tier counts as one counter,
``vllm:kvcore_tier_found_chunks``, labelled ``tier``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar, cast

import prometheus_client
from attrs import asdict
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvcore.scheduler import SchedulerStats

__all__ = ["COUNTERS", "GAUGES", "TIER_FOUND", "KVCorePromMetrics", "KVCoreStats", "StatsDelta"]

COUNTERS = {
    "lookups": "requests looked up in kvcore",
    "hit_tokens": "tokens kvcore offered beyond vLLM's own prefix hit",
    "loaded_blocks": "blocks loaded from kvcore",
    "async_loads": "loads run beside vLLM's steps, the request waiting for them alone",
    "saved_blocks": "blocks saved to kvcore",
    "failed_load_blocks": "blocks whose load failed (recomputed)",
    "failed_save_chunks": "chunks whose save failed (dropped)",
}
GAUGES = {
    "pool_capacity": "host slots (chunks) of the pool",
    "pool_used": "host slots in use (ready, being stored, or pinned)",
    "pool_pinned": "host slots pinned by loads in flight",
    "pool_storing": "host slots being stored",
    "pool_evictions": "chunks evicted since start",
    "requests": "requests kvcore tracks (live, or waiting for their copies)",
    "ops_in_flight": "copy ops not yet reported by every worker",
    "halted_ranks": "ranks whose copies are halted after a copy into vLLM's blocks hung (until it ends)",
}


@dataclass
class KVCoreStats(KVConnectorStats):
    """``data``: counter deltas and gauge values by name."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = value if key in GAUGES else self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: value for key, value in self.data.items() if isinstance(value, int | float)}

    def is_empty(self) -> bool:
        """Nothing to report: no counter moved and no gauge changed (vLLM drops empty stats, so a gauge
        that changed in a quiet step must make them non-empty, or an idle server shows stale values)."""
        return not any(self.data.get(key) for key in COUNTERS) and not any(key in self.data for key in GAUGES)


TIER_FOUND = "tier_found_"
"""The prefix of the per-tier counters: ``tier_found_1`` is the first remote tier behind the pool."""


class StatsDelta:
    """Turns the scheduler's running totals into per-step deltas, and its gauges into the values that
    changed since the last report."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._gauges: dict[str, int] = {}

    def __call__(self, stats: SchedulerStats, halted_ranks: int = 0) -> KVCoreStats:
        totals = {k: v for k, v in asdict(stats).items() if k in COUNTERS}
        totals.update((f"{TIER_FOUND}{i}", found) for i, found in enumerate(stats.tier_found, start=1))
        data: dict[str, Any] = {k: v - self._last.get(k, 0) for k, v in totals.items()}
        self._last = totals
        pool = stats.pool
        gauges = {
            "pool_capacity": pool.capacity,
            "pool_used": pool.used,
            "pool_pinned": pool.pinned,
            "pool_storing": pool.storing,
            "pool_evictions": pool.evictions,
            "requests": stats.requests,
            "ops_in_flight": stats.ops_in_flight,
            "halted_ranks": halted_ranks,
        }
        data.update((k, v) for k, v in gauges.items() if self._gauges.get(k) != v)
        self._gauges = gauges
        return KVCoreStats(data=data)


MetricT = TypeVar("MetricT", prometheus_client.Counter, prometheus_client.Gauge)


def _per_engine(metric: MetricT, labelvalues: dict[int, list[object]]) -> dict[int, MetricT]:
    """vLLM's per-engine children of ``metric``, keeping its own type (vLLM returns a union)."""
    return cast(dict[int, MetricT], create_metric_per_engine(metric, labelvalues))


class KVCorePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvcore_<counter>`` counters and ``vllm:kvcore_<gauge>`` gauges per engine (vLLM only exports
    metrics named ``vllm:*``)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM hands in its subclasses of prometheus_client's classes, typed as a union of all three
        counter_cls = cast("type[prometheus_client.Counter]", self._counter_cls)
        gauge_cls = cast("type[prometheus_client.Gauge]", self._gauge_cls)
        self._counters = {
            key: _per_engine(
                counter_cls(name=f"vllm:kvcore_{key}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, doc in COUNTERS.items()
        }
        self._tier_found = counter_cls(
            name="vllm:kvcore_tier_found_chunks",
            documentation="chunks each remote tier's lookups found beyond the pool (tier 1 first)",
            labelnames=[*labelnames, "tier"],
        )
        self._gauges = {
            key: _per_engine(
                gauge_cls(
                    name=f"vllm:kvcore_{key}",
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine_labelvalues,
            )
            for key, doc in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._counters and value:
                self._counters[key][engine_idx].inc(value)
            elif key.startswith(TIER_FOUND) and value:
                tier = key.removeprefix(TIER_FOUND)
                self._tier_found.labels(*self.per_engine_labelvalues[engine_idx], tier).inc(value)
            elif key in self._gauges:
                self._gauges[key][engine_idx].set(value)
