"""What kvcore needs to know of a vLLM engine, read from its config, and the scope it refuses.

Unsupported configurations are refused at start-up with a message that names them, never silently
mis-keyed: pipeline or context parallelism, several KV-cache groups (hybrid models), and caches whose
bytes kvcore does not describe (``kv_layout``: attention backends, memory orders, cache dtypes).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from kvcore.engine import EngineSpec
from kvcore.errors import UnsupportedConfiguration
from kvcore_vllm.kv_layout import CPU_BACKEND, cpu_packing, kv_dtype, kv_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["attention_backend", "engine_spec", "hash_identity", "layer_names"]

_FIXED_SEED = "vllm-none-hash"


def layer_names(kv_cache_config: KVCacheConfig) -> list[str]:
    """The attention layers of the one KV-cache group, in model order."""
    return list(kv_cache_config.kv_cache_groups[0].layer_names)


def engine_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineSpec:
    """The engine as kvcore sees it; raises ``UnsupportedConfiguration`` for what kvcore cannot key."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, name, 1)
        if size != 1:
            raise UnsupportedConfiguration(f"kvcore does not support {name}={size} yet (only 1)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedConfiguration(
            f"kvcore supports one KV-cache group; this model has {len(groups)} (hybrid attention)"
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec):  # MLA's spec is one
        raise UnsupportedConfiguration(
            f"kvcore's vLLM adapter supports full attention and MLA, not {type(spec).__name__}"
        )
    cache = vllm_config.cache_config
    if cache.kv_cache_dtype_skip_layers:
        raise UnsupportedConfiguration(
            f"kv_cache_dtype_skip_layers={cache.kv_cache_dtype_skip_layers}: kvcore needs one cache dtype "
            "for every layer"
        )
    model = vllm_config.model_config
    if not isinstance(model.dtype, torch.dtype):  # resolved from "auto" when vLLM builds its config
        raise UnsupportedConfiguration(f"model dtype: got {model.dtype!r}, expected a resolved torch.dtype")
    backend = attention_backend(vllm_config, list(groups[0].layer_names))
    packing = ""
    if backend == CPU_BACKEND:
        packing = cpu_packing(model.dtype, spec.block_size, spec.head_size, cache.cache_dtype)
    try:
        memory_order = cache.get_resolved_kv_cache_layout().name
    except ValueError as exc:  # vLLM resolves it in the engine core before connectors are built
        raise UnsupportedConfiguration(f"vLLM's KV cache layout is not resolved: {exc}") from None
    layout = kv_layout(backend, memory_order, spec, kv_cache_config.num_blocks, packing=packing)
    return EngineSpec(
        model_id=f"{model.model}@{model.revision or 'default'}",
        kv_dtype=kv_dtype(cache.cache_dtype, model.dtype),
        num_layers=len(groups[0].layer_names),
        total_kv_heads=1 if isinstance(spec, MLAAttentionSpec) else model.get_total_num_kv_heads(),
        layout=layout,
        tp_size=parallel.tensor_parallel_size,
    )


def attention_backend(vllm_config: VllmConfig, layer_names: list[str]) -> str:
    """The one attention backend of the layers, by vLLM's name for it (``FLASH_ATTN``, ``CPU_ATTN``, ...);
    where the model is not built in this process (the scheduler's), the one vLLM's selector picks."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    names = sorted({backend.get_name() for backend in get_current_attn_backends(vllm_config, layer_names)})
    if len(names) != 1:
        raise UnsupportedConfiguration(f"the layers use several attention backends: {names}")
    return names[0]


def hash_identity(vllm_config: VllmConfig) -> tuple[str, bool]:
    """Which chain vLLM's block hashes come from (algorithm and seed), and whether that seed is drawn at
    random per process (xxhash without ``PYTHONHASHSEED``): then no other process can share the keys."""
    algorithm = vllm_config.cache_config.prefix_caching_hash_algo
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None and algorithm.startswith("sha256"):
        seed = _FIXED_SEED
    return f"vllm/{algorithm}/{seed}", seed is None
