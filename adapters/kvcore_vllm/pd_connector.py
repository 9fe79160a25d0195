"""``KVCorePDConnector``: disaggregated prefill/decode over Mooncake's transfer engine, as a vLLM connector.

The producer (prefill engine) pushes a finished prompt's KV into the consumer's (decode engine's) blocks;
``kv_transfer_params`` carry what the decode engine needs (``pd_params``, ``docs/pd.md``). One class
serves both of vLLM's connector roles: it builds the scheduler side (``pd_scheduler``) or a rank's worker
side (``pd_worker``) and delegates every hook. Configuration comes from ``kv_connector_extra_config``
(kvcore's config, whose ``pd`` section is required); ``kv_role`` picks producer, consumer or both.

It supports vLLM's hybrid KV-cache manager (``SupportsHMA``): a model of sliding-window and full attention
layers moves each group's blocks (a sliding window's blocks before the window are vLLM's null block on
the decode engine, and move nothing), a hybrid SSM model the state block of each Mamba group too (split
over ranks in its parts, ``kvcore.model.state_plan``, so that the engines' TP sizes may differ),
both engines stopping one token short of the prompt (``PDScheduler.on_new_request``); a failed pull of
such a model, or of one whose layers all have a sliding window, is told to vLLM by request
(``failed_recving``), which recomputes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvcore.config import load_pd_config
from kvcore.errors import InvalidSpecError
from kvcore_vllm.compat import check_vllm
from kvcore_vllm.engine_spec import pd_engine
from kvcore_vllm.kv_layout import requested_order
from kvcore_vllm.pd_metadata import PDMetadata
from kvcore_vllm.pd_scheduler import PDRole, PDScheduler
from kvcore_vllm.pd_worker import PDWorker
from kvcore_vllm.preflight import check_pd
from kvcore_vllm.roles import require_side
from kvcore_vllm.state_steps import StateSteps

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVCorePDConnector"]

check_vllm(vllm.__version__, KVConnectorBase_V1)


class KVCorePDConnector(KVConnectorBase_V1, SupportsHMA):
    """kvcore's P/D connector. Configure it through ``kv_connector_extra_config`` (see ``docs/pd.md``)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        extra = transfer.kv_connector_extra_config
        check_pd(extra, transfer.kv_role)
        pd = load_pd_config(extra)
        pd_role = PDRole(transfer.kv_role)
        engine_id = transfer.engine_id or "kvcore"
        moved = pd_engine(vllm_config, kv_cache_config)
        engine = moved.engine
        self._by_request = moved.failures_by_request
        self._scheduler: PDScheduler | None = None
        self._worker: PDWorker | None = None
        self._steps: StateSteps | None = None
        if role == KVConnectorRole.SCHEDULER:
            if moved.state_block is not None:
                self._steps = StateSteps(vllm_config.cache_config, moved.state_block)
            self._scheduler = PDScheduler.of(pd_role, engine_id, moved, pd)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if engine.tp_size > 1 else 0
            self._worker = PDWorker(pd_role, moved, pd, engine_id, rank)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return requested_order(vllm_config.model_config.use_mla)

    @property
    def scheduler_side(self) -> PDScheduler:
        return require_side(self._scheduler, "scheduler")

    @property
    def worker_side(self) -> PDWorker:
        return require_side(self._worker, "worker")

    # -- worker side -------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PDMetadata):
            raise InvalidSpecError(f"unexpected connector metadata {type(meta).__name__}")
        self.worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: requests wait in WAITING_FOR_REMOTE_KVS, not per layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # the producer sends whole blocks after the request finished, not layer by layer

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self.worker_side
        sent, received = worker.get_finished()
        failed = worker.take_failed()
        if self._by_request:  # several groups or a window: vLLM takes a failed load by request
            worker.take_load_errors()
            return KVConnectorTransferResults(set(sent or ()), set(received or ()), failed)
        return KVConnectorTransferResults(set(sent or ()), set(received or ()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self.worker_side.take_load_errors()
        return set() if self._by_request else errors

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side ----------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._steps is not None:  # before vLLM cuts the request's first step
            self._steps.keep()
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self.scheduler_side.on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)
