"""``KVCoreConnector``: kvcore as a vLLM V1 KV connector (``KVConnectorBase_V1``).

One class serves both roles, as vLLM requires; it builds the scheduler side or the worker side from the
validated config and delegates every hook to it. Configuration errors and unsupported engine
configurations stop the engine at start-up with a message naming the field or the feature.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvcore
from kvcore.config import KVCoreConfig
from kvcore.config.describe import describe
from kvcore.errors import InvalidSpecError, UnsupportedConfiguration
from kvcore.kit.settings import format_size
from kvcore.model.head_runs import splits
from kvcore.plugins.sizing import pool_slots, slot_bytes, staging_shortfall
from kvcore_vllm.compat import check_vllm
from kvcore_vllm.engine_spec import KVGroup, hash_block_tokens, hash_identity, kv_groups, pd_engine
from kvcore_vllm.grouped_scheduler import GroupedSchedulerSide
from kvcore_vllm.grouped_worker import GroupedWorkerSide
from kvcore_vllm.kv_layout import requested_order
from kvcore_vllm.metadata import GroupedMetadata, KVCoreMetadata
from kvcore_vllm.pd_metadata import PDTiersMetadata
from kvcore_vllm.pd_scheduler import PDRole, PDScheduler
from kvcore_vllm.pd_tiers_scheduler import PDTiersScheduler
from kvcore_vllm.pd_tiers_worker import PDTiersWorker
from kvcore_vllm.pd_worker import PDWorker
from kvcore_vllm.rank_agreement import RankAgreement, alone, over_group
from kvcore_vllm.roles import require_side
from kvcore_vllm.scheduler_side import SchedulerSide
from kvcore_vllm.settings import StorePolicy, core_mapping, extra_mapping, read_extra_config
from kvcore_vllm.state_steps import StateSteps
from kvcore_vllm.stats import KVCorePromMetrics, KVCoreStats, StatsDelta
from kvcore_vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVCoreConnector"]

log = logging.getLogger(__name__)

check_vllm(vllm.__version__, KVConnectorBase_V1)

Side = TypeVar("Side")
Grouped = TypeVar("Grouped")


class KVCoreConnector(KVConnectorBase_V1, SupportsHMA):
    """kvcore's connector. Configure it through ``kv_connector_extra_config`` (see ``docs/vllm.md``).

    It supports vLLM's hybrid KV-cache manager (``SupportsHMA``): a model of several KV-cache groups
    (sliding-window and full attention layers) is served group by group (``GroupedSchedulerSide``,
    ``GroupedWorkerSide``), so vLLM keeps its hybrid manager on with kvcore configured."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        settings = read_extra_config(extra)
        groups = kv_groups(vllm_config, kv_cache_config)
        states = [group for group in groups if group.kind == "mamba"]
        if states and not settings.chunk_tokens_set:
            # vLLM sizes a hybrid SSM model's blocks to fit a state; a state is kept per block
            block = states[0].engine.layout.block_tokens
            settings = attrs.evolve(settings, core=attrs.evolve(settings.core, chunk_tokens=block))
        config = settings.core
        if settings.store_policy is StorePolicy.LAZY and (len(groups) > 1 or groups[0].window is not None):
            raise UnsupportedConfiguration(
                "store_policy 'lazy' does not support sliding-window or hybrid models (vLLM frees their "
                "blocks outside the window, not only at eviction); use 'eager'"
            )
        engine = groups[0].engine
        # several groups, or a sliding window: served by the grouped sides, whose load failures vLLM takes
        # by request (a recompute from a failed block would attend to blocks vLLM gave back)
        grouped = len(groups) > 1 or groups[0].window is not None
        transfer = self._kv_transfer_config
        pd_role = None if config.pd is None else PDRole.of(transfer.kv_role)
        moved = None if config.pd is None else pd_engine(vllm_config, kv_cache_config)
        self._hands_off = pd_role is not None and pd_role.produces
        engine_id = transfer.engine_id or "kvcore"
        self._scheduler: SchedulerSide | GroupedSchedulerSide | PDTiersScheduler | None = None
        self._steps: StateSteps | None = None
        self._worker: WorkerSide | GroupedWorkerSide | PDTiersWorker | None = None
        self._stats_delta = StatsDelta()
        if role == KVConnectorRole.SCHEDULER:
            identity, random_seed = hash_identity(vllm_config)
            if random_seed:
                log.warning(
                    "kvcore: vLLM's prefix-cache hash seed is random per process (%s without "
                    "PYTHONHASHSEED); cached KV is reusable within this engine only",
                    vllm_config.cache_config.prefix_caching_hash_algo,
                )
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning(
                    "kvcore: kv_load_failure_policy=%r ends a request when a load fails; "
                    "set it to 'recompute' to fall back to computing the blocks instead",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
            hash_block = hash_block_tokens(kv_cache_config, groups)
            if states:
                self._steps = StateSteps(vllm_config.cache_config, states[0].engine.layout.block_tokens)
            self._scheduler = _per_group(
                grouped,
                groups,
                lambda g: SchedulerSide(
                    settings,
                    g.engine,
                    hash_block,
                    identity,
                    group=g.index,
                    window=g.window,
                    failures_by_request=grouped,
                ),
                GroupedSchedulerSide,
            )
            if config.pd is not None and pd_role is not None and moved is not None:
                pd = PDScheduler.of(pd_role, engine_id, moved, config.pd)
                self._scheduler = PDTiersScheduler(self._scheduler, pd)
            for group in groups:
                shortfall = staging_shortfall(
                    config, group.engine, vllm_config.scheduler_config.max_num_batched_tokens
                )
                if shortfall is not None:
                    log.warning("%s", shortfall)
            log.info(
                "kvcore %s scheduler side: %s; %s; store policy %s, load mode %s; model %s",
                kvcore.__version__,
                describe(
                    config,
                    core_mapping(extra_mapping(self._kv_transfer_config.kv_connector_extra_config)),
                    heads_split=all(splits(group.engine.layout) for group in groups),
                ),
                _pool(config, groups),
                settings.store_policy.value,
                settings.load_mode.value,
                engine.model_id,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group

            rank = 0
            agree: RankAgreement = alone
            if engine.tp_size > 1:
                rank = get_tensor_model_parallel_rank()
                # each rank reaches the collective after its own wait of at most transfer_timeout_s
                agree = over_group(get_tp_group().cpu_group, 2 * config.transfer_timeout_s + 5.0)
            self._worker = _per_group(
                grouped,
                groups,
                lambda g: WorkerSide(
                    config, g.engine, list(g.layers), rank, faults=settings.faults, agree=agree
                ),
                GroupedWorkerSide,
            )
            if config.pd is not None and pd_role is not None and moved is not None:
                pulls = PDWorker(pd_role, moved, config.pd, engine_id, rank)
                self._worker = PDTiersWorker(self._worker, pulls)
            log.info(
                "kvcore %s worker side, rank %d of %d: %s",
                kvcore.__version__,
                rank,
                engine.tp_size,
                _pool(config, groups),
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return requested_order(vllm_config.model_config.use_mla)

    @property
    def requires_kv_delivery(self) -> bool:
        # a cache is best effort: a dropped save is a future miss, never lost output; a P/D producer's
        # finished prefill is handed to a consumer, so vLLM recomputes one preempted before its hand-off
        return self._hands_off

    @property
    def scheduler_side(self) -> SchedulerSide | GroupedSchedulerSide | PDTiersScheduler:
        side = self._scheduler
        return side if side is not None else require_side(side, "scheduler")

    @property
    def worker_side(self) -> WorkerSide | GroupedWorkerSide | PDTiersWorker:
        side = self._worker
        return side if side is not None else require_side(side, "worker")

    def _meta(self) -> Any:
        meta = self._get_connector_metadata()
        expected: type[KVConnectorMetadata] = KVCoreMetadata
        if isinstance(self._worker, GroupedWorkerSide):
            expected = GroupedMetadata
        elif isinstance(self._worker, PDTiersWorker):
            expected = PDTiersMetadata
        if not isinstance(meta, expected):
            raise InvalidSpecError(f"unexpected connector metadata {type(meta).__name__}")
        return meta

    # -- worker side -------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        worker = self.worker_side
        if isinstance(worker, GroupedWorkerSide):
            if isinstance(kv_connector_metadata, GroupedMetadata):
                worker.handle_preemptions(kv_connector_metadata)
        elif isinstance(worker, PDTiersWorker):
            if isinstance(kv_connector_metadata, PDTiersMetadata):
                worker.handle_preemptions(kv_connector_metadata)
        elif isinstance(kv_connector_metadata, KVCoreMetadata):
            worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads are in place before the forward pass reads them (start_load_kv)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # whole blocks of every layer are saved once, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self.worker_side
        if isinstance(worker, GroupedWorkerSide | PDTiersWorker):
            sent, received, failed = worker.transfer_results()
            return KVConnectorTransferResults(sent, received, failed)
        sending, receiving = worker.get_finished()
        if isinstance(worker, WorkerSide):
            worker.take_failed_loads(receiving or ())  # one group: failed blocks tell vLLM, by block
        return KVConnectorTransferResults(set(sending or ()), set(receiving or ()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.worker_side
        return set() if isinstance(worker, GroupedWorkerSide) else worker.take_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self.worker_side.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side ----------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._steps is not None:  # before vLLM cuts the request's first step
            self._steps.keep()
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        side = self.scheduler_side
        if isinstance(side, PDTiersScheduler):
            side.pd.on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        side = self.scheduler_side
        if isinstance(side, GroupedSchedulerSide):
            side.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)
        elif isinstance(side, PDTiersScheduler):
            side.update_state_after_alloc(request, blocks, num_external_tokens)
        else:
            side.update_state_after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        side = self.scheduler_side
        if isinstance(side, GroupedSchedulerSide | PDTiersScheduler):
            return side.request_finished(request, block_ids)
        return side.request_finished(request, block_ids[0])

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """vLLM's hits by source: with P/D beside the tiers, the producer's part is ``p2p``."""
        side = self._scheduler
        pulled = side.take_pulled(request.request_id) if isinstance(side, PDTiersScheduler) else 0
        pulled = min(pulled, num_external_tokens)
        if not pulled:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        split = {self._cache_hit_source: num_external_tokens - pulled, CacheHitSource.P2P: pulled}
        return {source: tokens for source, tokens in split.items() if tokens}

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        side = self.scheduler_side
        return side.loaded_groups() if isinstance(side, GroupedSchedulerSide | PDTiersScheduler) else (0,)

    def reset_cache(self) -> bool | None:
        return self.scheduler_side.reset_cache()

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.scheduler_side.bind_gpu_block_pool(gpu_block_pool)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler_side.take_events()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is None:
            return None
        return self._stats_delta(self._scheduler.stats(), len(self._scheduler.halted_ranks))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVCoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVCorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _pool(config: KVCoreConfig, groups: Sequence[KVGroup]) -> str:
    """The host pool a rank holds, per KV-cache group: slots, their size, and the memory in all."""
    parts = []
    for group in groups:
        slots = pool_slots(config, group.engine, group.engine.tp_size)
        size = slot_bytes(config, group.engine)
        named = f"group {group.index}: " if len(groups) > 1 else ""
        parts.append(f"{named}{slots} slots of {format_size(size)} per rank ({format_size(slots * size)})")
        if slots == 0:
            parts[-1] = f"{named}no host pool (blocks move straight to the tier)"
    return "host pool: " + ", ".join(parts)


def _per_group(
    grouped: bool,
    groups: tuple[KVGroup, ...],
    make: Callable[[KVGroup], Side],
    grouped_side: Callable[[list[Side]], Grouped],
) -> Side | Grouped:
    """The grouped side over one side per group, or (``grouped`` false) the side of the one group."""
    sides = [make(group) for group in groups]
    return grouped_side(sides) if grouped else sides[0]
