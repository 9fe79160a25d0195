"""Connector statistics: vLLM's ``KVConnectorStats`` for its log, and Prometheus metrics (``vllm:kvcore_*``).

The scheduler side reports, each step, the counters that moved since the previous step (lookups, hit
tokens, loaded and saved blocks, failures, save retries: a chunk counts once however often its save is
retried, the retries apart) and the pool's current usage (gauges, named ``pool_*``); per remote tier
``n`` (1: the first behind the pool), the chunks its lookups found, the chunks it stored and its
evictions (counters ``tier_found_<n>``, ``tier_stored_<n>``, ``tier_evictions_<n>``) and, for
a tier that can tell, its bytes in use and its size (gauges ``tier_used_bytes_<n>``,
``tier_capacity_bytes_<n>``). Aggregating adds counters
and keeps the latest gauges. Prometheus shows each per-tier figure as one metric labelled ``tier``
(``vllm:kvcore_tier_found_chunks{tier="1"}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar, cast

import prometheus_client
from attrs import asdict
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvcore.config import KVCoreConfig, load_config
from kvcore.errors import ConfigError
from kvcore.kit.settings import BackendSettings
from kvcore.plugins.preflight import tier_fields
from kvcore.scheduling.scheduler import SchedulerStats
from kvcore_vllm.settings import core_mapping, extra_mapping

__all__ = [
    "COUNTERS",
    "GAUGES",
    "TIER_COUNTERS",
    "TIER_GAUGES",
    "KVCorePromMetrics",
    "KVCoreStats",
    "StatsDelta",
]

COUNTERS = {
    "lookups": "requests looked up in kvcore",
    "hit_tokens": "tokens kvcore offered beyond vLLM's own prefix hit",
    "loaded_blocks": "blocks loaded from kvcore",
    "async_loads": "loads run beside vLLM's steps, the request waiting for them alone",
    "saved_blocks": "blocks saved to kvcore",
    "failed_load_blocks": "blocks whose load failed (recomputed; a failed load is never retried)",
    "failed_save_chunks": "chunks whose save failed (dropped), each once however often it is retried",
    "save_retries": "saves of a chunk again after its save failed (one per chunk per retry)",
    "written_back_chunks": "pool chunks written back to the tiers written back before their eviction "
    "(each once, those no tier stored included)",
    "failed_write_back_chunks": "chunks whose write-back no tier stored (the pool keeps them, clean)",
    "assembled_chunks": "chunks loaded from tiers that keep a value per KV head, each rank assembling its "
    "shard from its heads' values whatever TP size wrote them",
}
GAUGES = {
    "pool_capacity": "host slots (chunks) of the pool (reported with the first engine step)",
    "pool_capacity_bytes": "host memory of the pool, every rank's (set at start-up, from the config)",
    "pool_used": "host slots in use (ready, being stored, or pinned)",
    "pool_pinned": "host slots pinned by loads in flight",
    "pool_storing": "host slots being stored",
    "pool_dirty": "chunks of the pool not yet written back (never evicted until they are)",
    "pool_evictions": "chunks evicted since start",
    "requests": "requests kvcore tracks (live, or waiting for their copies or P/D pulls)",
    "ops_in_flight": "copy ops not yet reported by every worker",
    "halted_ranks": "ranks whose copies are halted after a copy into vLLM's blocks hung (until it ends)",
}


TIER_COUNTERS = {
    "tier_found": "chunks each remote tier's lookups found beyond the pool (tier 1 first)",
    "tier_stored": "chunks each remote tier stored (every shard), from saves and write-backs",
    "tier_evictions": "values each remote tier evicted (every process sharing it)",
}
TIER_GAUGES = {
    "tier_used_bytes": "bytes each remote tier holds (tiers that can tell)",
    "tier_capacity_bytes": "bytes each remote tier may hold (tiers that can tell)",
}


def _tier_metric(key: str) -> tuple[str, str] | None:
    """``("tier_found", "2")`` for ``tier_found_2``; ``None`` for a key that is no per-tier figure."""
    name, _, tier = key.rpartition("_")
    return (name, tier) if (name in TIER_COUNTERS or name in TIER_GAUGES) and tier.isdigit() else None


def _is_gauge(key: str) -> bool:
    tier = _tier_metric(key)
    return key in GAUGES or (tier is not None and tier[0] in TIER_GAUGES)


@dataclass
class KVCoreStats(KVConnectorStats):
    """``data``: counter deltas and gauge values by name."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = value if _is_gauge(key) else self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: value for key, value in self.data.items() if isinstance(value, int | float)}

    def is_empty(self) -> bool:
        """Nothing to report: no counter moved and no gauge changed (vLLM drops empty stats, so a gauge
        that changed in a quiet step must make them non-empty, or an idle server shows stale values)."""
        return not any(_is_gauge(key) or value for key, value in self.data.items())


class StatsDelta:
    """Turns the scheduler's running totals into per-step deltas, and its gauges into the values that
    changed since the last report."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._gauges: dict[str, int] = {}

    def __call__(self, stats: SchedulerStats, halted_ranks: int = 0) -> KVCoreStats:
        totals = {k: v for k, v in asdict(stats).items() if k in COUNTERS}
        totals.update((f"tier_found_{i}", found) for i, found in enumerate(stats.tier_found, start=1))
        totals.update((f"tier_stored_{i}", n) for i, n in enumerate(stats.tier_stored, start=1))
        usage = {i: u for i, u in enumerate(stats.tier_usage, start=1) if u is not None}
        evictions = {f"tier_evictions_{i}": u.evictions for i, u in usage.items()}
        totals.update(evictions)
        # a shared tier's evictions count from before this engine: the first report is the baseline
        self._last.update((k, v) for k, v in evictions.items() if k not in self._last)
        # a shared counter that went back (its lock file made again) restarts from there, never negative
        data: dict[str, Any] = {k: max(v - self._last.get(k, 0), 0) for k, v in totals.items()}
        self._last = totals
        pool = stats.pool
        gauges = {
            "pool_capacity": pool.capacity,
            "pool_used": pool.used,
            "pool_pinned": pool.pinned,
            "pool_storing": pool.storing,
            "pool_dirty": pool.dirty,
            "pool_evictions": pool.evictions,
            "requests": stats.requests,
            "ops_in_flight": stats.ops_in_flight,
            "halted_ranks": halted_ranks,
            **{f"tier_used_bytes_{i}": u.used_bytes for i, u in usage.items()},
            **{f"tier_capacity_bytes_{i}": u.capacity_bytes for i, u in usage.items()},
        }
        data.update((k, v) for k, v in gauges.items() if self._gauges.get(k) != v)
        self._gauges = gauges
        return KVCoreStats(data=data)


def _remote(config: KVCoreConfig) -> list[BackendSettings]:
    """The settings of each remote tier behind the pool (tier 1 first): a stack's, or the one backend's
    where it is a remote tier (with its own pool in front)."""
    tiers = [settings for _, settings in tier_fields(config)]
    return tiers[1:] if len(tiers) > 1 else [t for t in tiers if t.REMOTE]


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
        # per tier: one metric each, labelled by tier too (children made as tiers report)
        names = {
            "tier_found": "vllm:kvcore_tier_found_chunks",
            "tier_stored": "vllm:kvcore_tier_stored_chunks",
        }
        tiered = [*labelnames, "tier"]
        self._tiers: dict[str, prometheus_client.Counter | prometheus_client.Gauge] = {
            key: counter_cls(name=names.get(key, f"vllm:kvcore_{key}"), documentation=doc, labelnames=tiered)
            for key, doc in TIER_COUNTERS.items()
        }
        self._tiers.update(
            (key, gauge_cls(f"vllm:kvcore_{key}", doc, labelnames=tiered, multiprocess_mode="mostrecent"))
            for key, doc in TIER_GAUGES.items()
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
        self._set_capacities(vllm_config)

    def _set_capacities(self, vllm_config: Any) -> None:
        """The capacities the config decides, set at start-up (before any step reports): the pool's
        bytes, and the size of each remote tier that has one (the disk's)."""
        extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None)
        try:
            config = load_config(core_mapping(extra_mapping(extra or {})))
        except ConfigError:  # not kvcore's connector's config, or one the pre-flight refused already
            return
        sizes = {n: getattr(settings, "size", None) for n, settings in enumerate(_remote(config), start=1)}
        capacity = cast(prometheus_client.Gauge, self._tiers["tier_capacity_bytes"])
        for engine, labels in self.per_engine_labelvalues.items():
            self._gauges["pool_capacity_bytes"][engine].set(config.backend.host_bytes)
            for n, size in sizes.items():
                if isinstance(size, int):
                    capacity.labels(*labels, str(n)).set(size)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._counters and value:
                self._counters[key][engine_idx].inc(value)
            elif key in self._gauges:
                self._gauges[key][engine_idx].set(value)
            elif (tiered := _tier_metric(key)) is not None:
                metric = self._tiers[tiered[0]].labels(*self.per_engine_labelvalues[engine_idx], tiered[1])
                if isinstance(metric, prometheus_client.Gauge):
                    metric.set(value)
                elif value:
                    metric.inc(value)
