"""``KVCoreConnector``: kvcore as a vLLM V1 KV connector (``KVConnectorBase_V1``).

One class serves both roles, as vLLM requires; it builds the scheduler side or the worker side from the
validated config and delegates every hook to it. Configuration errors and unsupported engine
configurations stop the engine at start-up with a message naming the field or the feature.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from attrs import asdict
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcore.errors import InvalidSpecError
from kvcore.sizing import staging_shortfall
from kvcore_vllm.compat import check_vllm
from kvcore_vllm.engine_spec import engine_spec, hash_identity, layer_names
from kvcore_vllm.kv_layout import requested_order
from kvcore_vllm.metadata import KVCoreMetadata
from kvcore_vllm.rank_agreement import RankAgreement, alone, over_group
from kvcore_vllm.roles import require_side
from kvcore_vllm.scheduler_side import SchedulerSide
from kvcore_vllm.settings import read_extra_config
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


class KVCoreConnector(KVConnectorBase_V1):
    """kvcore's connector. Configure it through ``kv_connector_extra_config`` (see ``docs/vllm.md``)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = read_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        config = settings.core
        engine = engine_spec(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
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
            hash_block = kv_cache_config.hash_block_size or engine.layout.block_tokens
            self._scheduler = SchedulerSide(settings, engine, hash_block, identity)
            shortfall = staging_shortfall(config, engine, vllm_config.scheduler_config.max_num_batched_tokens)
            if shortfall is not None:
                log.warning("%s", shortfall)
            log.info(
                "kvcore: scheduler side ready (store policy %s, load mode %s): %s",
                settings.store_policy.value,
                settings.load_mode.value,
                asdict(config, filter=lambda a, _: a.name != "secret"),
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group

            rank = 0
            agree: RankAgreement = alone
            if engine.tp_size > 1:
                rank = get_tensor_model_parallel_rank()
                # each rank reaches the collective after its own wait of at most transfer_timeout_s
                agree = over_group(get_tp_group().cpu_group, 2 * config.transfer_timeout_s + 5.0)
            layers = layer_names(kv_cache_config)
            self._worker = WorkerSide(config, engine, layers, rank, faults=settings.faults, agree=agree)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return requested_order(vllm_config.model_config.use_mla)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache is best effort: a dropped save is a future miss, never lost output

    @property
    def scheduler_side(self) -> SchedulerSide:
        return require_side(self._scheduler, "scheduler")

    @property
    def worker_side(self) -> WorkerSide:
        return require_side(self._worker, "worker")

    def _meta(self) -> KVCoreMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCoreMetadata):
            raise InvalidSpecError(f"unexpected connector metadata {type(meta).__name__}")
        return meta

    # -- worker side -------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVCoreMetadata):
            self.worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads complete in start_load_kv, before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # whole blocks of every layer are saved once, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self.worker_side.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.core.close()

    # -- scheduler side ----------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

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
