"""What kvcore needs to know of a vLLM engine, read from its config, and the scope it refuses.

Unsupported configurations are refused at start-up with a message that names them, never silently
mis-keyed: pipeline or context parallelism, several KV-cache groups (hybrid models), MLA, and KV caches
that are not vLLM's CPU layout (the CUDA layouts exist in kvcore's core but the adapter has only been
run on vLLM's CPU build).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from kvcore.engine import EngineSpec
from kvcore.errors import UnsupportedConfiguration
from kvcore.layout import KVLayout, LayoutKind

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["engine_spec", "hash_identity", "layer_names"]

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
    if isinstance(spec, MLAAttentionSpec) or not isinstance(spec, FullAttentionSpec):
        raise UnsupportedConfiguration(
            f"kvcore's vLLM adapter supports full attention, not {type(spec).__name__}"
        )
    if not vllm_config.device_config.device_type == "cpu":
        raise UnsupportedConfiguration(
            "kvcore's vLLM adapter has been run on vLLM's CPU build only; CUDA layouts are not wired yet"
        )
    model = vllm_config.model_config
    dtype_size = torch.empty((), dtype=spec.dtype).element_size()
    layout = KVLayout(
        kind=LayoutKind.VLLM_CPU,
        num_blocks=kv_cache_config.num_blocks,
        block_tokens=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype_size=dtype_size,
    )
    return EngineSpec(
        model_id=f"{model.model}@{model.revision or 'default'}",
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        num_layers=len(groups[0].layer_names),
        total_kv_heads=model.get_total_num_kv_heads(),
        layout=layout,
        tp_size=parallel.tensor_parallel_size,
    )


def hash_identity(vllm_config: VllmConfig) -> tuple[str, bool]:
    """Which chain vLLM's block hashes come from (algorithm and seed), and whether that seed is drawn at
    random per process (xxhash without ``PYTHONHASHSEED``): then no other process can share the keys."""
    algorithm = vllm_config.cache_config.prefix_caching_hash_algo
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None and algorithm.startswith("sha256"):
        seed = _FIXED_SEED
    return f"vllm/{algorithm}/{seed}", seed is None
