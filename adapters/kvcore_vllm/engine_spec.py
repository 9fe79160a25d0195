"""What kvcore needs to know of a vLLM engine, read from its config, and the scope it refuses.

A model may keep KV of several kinds (vLLM's hybrid KV-cache manager: sliding-window and full attention
layers, or Mamba layers' states, in groups, each with its own block table): each group is one
``KVGroup``, keyed apart. Unsupported configurations are refused at start-up with a message that names
them, never silently mis-keyed: pipeline or context parallelism, KV-cache groups of other kinds (local or
sparse attention), and caches whose bytes kvcore does not describe (``kv_layout``: attention backends,
memory orders, cache dtypes; ``state_layout``: Mamba states outside "align" mode). Groups may have blocks
of different sizes (vLLM gives every group one page size).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch
from attrs import frozen

from kvcore.errors import InvalidSpecError, UnsupportedConfiguration
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.state_plan import StateLayout
from kvcore_vllm.kv_layout import CPU_BACKEND, cpu_packing, kv_dtype, kv_layout, state_layout, state_parts
from kvcore_vllm.model_identity import model_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "KVGroup",
    "PDEngine",
    "attention_backend",
    "hash_block_tokens",
    "hash_identity",
    "kv_groups",
    "page_engine",
    "pd_engine",
]

_FIXED_SEED = "vllm-none-hash"


@frozen
class KVGroup:
    """One of vLLM's KV-cache groups as kvcore keeps it: the layers that share one block table, of one
    ``kind`` (``full``, ``mla``, ``sliding_window`` of ``window`` tokens, or ``mamba``: a recurrent state per
    block, whose window is one block), and the engine kvcore sees for them (its ``model_id`` names the
    group when the model has several, so groups never share keys)."""

    index: int
    kind: str
    window: int | None
    layers: tuple[str, ...]
    engine: EngineSpec


@frozen
class PDEngine:
    """What P/D moves of an engine: blocks of its KV tensors, whatever KV-cache group holds them.

    ``engine`` is the model's (keyed by the model, not by a group) with the layout every group's layers
    share (its ``num_layers`` counts every group's; layers of several groups share one tensor, and the
    worker keeps, and the handshake counts, one view per tensor); for a hybrid SSM model, a ``STATE``
    layout of whole pages (``page_engine``), the memory the worker registers, and what a page holds:
    ``attention``, the attention layers' K and V at the start of a page of an attention group's block,
    and ``state``, the recurrent state from the start of a page of a block of ``state_groups`` (each moved
    by its own plan, so that engines of different TP sizes exchange both). ``layers`` are every group's
    layers in vLLM's group order; ``groups`` is how many block tables a request has; ``windowed`` whether
    a group has a window (a sliding window, or a Mamba state's block): then both engines stop one token
    short of the prompt; ``hash_block`` the tokens of vLLM's block hashes; ``state_block`` the Mamba
    groups' block size, if any.
    """

    engine: EngineSpec
    layers: tuple[str, ...]
    groups: int
    windowed: bool
    hash_block: int
    state_block: int | None = None
    attention: EngineSpec | None = None
    state: StateLayout | None = None
    state_groups: frozenset[int] = frozenset()

    @property
    def failures_by_request(self) -> bool:
        """vLLM takes a failed load by request, not by block (several groups, or a sliding window: a
        recompute from a failed block would attend to blocks vLLM gave back)."""
        return self.groups > 1 or self.windowed

    @property
    def kv(self) -> EngineSpec:
        """The engine whose KV layout a block of an attention group has: ``attention`` or ``engine``."""
        return self.engine if self.attention is None else self.attention


def pd_engine(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> PDEngine:
    """The engine as the P/D connectors see it; raises ``UnsupportedConfiguration`` for attention groups
    whose KV differs in layout, dtype or heads, and for a hybrid SSM model whose groups' pages differ or
    whose states kvcore cannot split over TP ranks (``kv_layout.state_parts``)."""
    groups = kv_groups(vllm_config, kv_cache_config)
    layers = tuple(name for group in groups for name in group.layers)
    windowed = any(group.window is not None for group in groups)
    hashed = hash_block_tokens(kv_cache_config, groups)
    identity = model_identity(vllm_config)
    states = [group for group in groups if group.kind == "mamba"]
    if not states:
        return PDEngine(_shared_kv(groups, identity, len(layers)), layers, len(groups), windowed, hashed)
    pages = {group.kv_cache_spec.page_size_bytes for group in kv_cache_config.kv_cache_groups}
    if len(pages) != 1:
        raise UnsupportedConfiguration(f"P/D of a hybrid SSM model whose groups' pages differ: {pages}")
    engine = page_engine(identity, groups, pages.pop())
    attention = [group for group in groups if group.kind != "mamba"]
    if not attention:
        raise UnsupportedConfiguration("P/D of a model of Mamba layers only: kvcore moves hybrid SSM models")
    from vllm.v1.kv_cache_interface import MambaSpec

    tp_size = vllm_config.parallel_config.tensor_parallel_size
    specs = [kv_cache_config.kv_cache_groups[group.index].kv_cache_spec for group in states]
    mamba = [spec for spec in specs if isinstance(spec, MambaSpec)]
    if len(mamba) != len(specs):
        kinds = sorted({type(spec).__name__ for spec in specs})
        raise UnsupportedConfiguration(f"P/D of a hybrid SSM model whose state groups' specs are {kinds}")
    parts = {state_parts(spec, tp_size) for spec in mamba}
    if len(parts) != 1:
        raise UnsupportedConfiguration(f"P/D of a hybrid SSM model whose state groups differ: {parts}")
    return PDEngine(
        engine,
        layers,
        len(groups),
        windowed,
        hashed,
        state_block=states[0].engine.layout.block_tokens,
        attention=_shared_kv(attention, identity, len(layers)),
        state=parts.pop(),
        state_groups=frozenset(group.index for group in states),
    )


def _shared_kv(groups: Sequence[KVGroup], model_id: str, num_layers: int) -> EngineSpec:
    """The one KV layout the attention ``groups`` share, as the model's engine of ``num_layers`` layers;
    ``UnsupportedConfiguration`` naming the group that differs."""
    first = groups[0].engine
    shape = (first.layout, first.kv_dtype, first.total_kv_heads)
    for group in groups[1:]:
        other = group.engine
        if (other.layout, other.kv_dtype, other.total_kv_heads) != shape:
            raise UnsupportedConfiguration(
                f"P/D of a model whose KV-cache groups differ: group {group.index} ({group.kind}) has "
                f"{_described(other)}; group {groups[0].index} ({groups[0].kind}) {_described(first)}: P/D "
                "moves blocks of one layout"
            )
    return attrs.evolve(
        first, model_id=model_id, num_layers=num_layers, sibling_block_bytes=0, window_tokens=None
    )


def hash_block_tokens(kv_cache_config: KVCacheConfig, groups: Sequence[KVGroup]) -> int:
    """The tokens of vLLM's block hashes: vLLM's setting, else its rule (the block size every group's is a
    multiple of)."""
    return kv_cache_config.hash_block_size or math.gcd(*(g.engine.layout.block_tokens for g in groups))


def page_engine(model_id: str, groups: Sequence[KVGroup], page: int) -> EngineSpec:
    """P/D's engine for a hybrid SSM model: every layer's blocks as whole pages of ``page`` bytes (vLLM
    gives every group's layers one page size; layer ``i`` of each group views the same pages, an attention
    layer as its K and V, a Mamba layer as its state): the memory a worker registers, one "head" per rank.
    Raises ``UnsupportedConfiguration`` where the groups' blocks lie apart differently."""
    strides = {group.engine.layout.block_stride for group in groups}
    first = groups[0].engine
    if len(strides) != 1:
        raise UnsupportedConfiguration(
            f"P/D of a hybrid SSM model whose KV-cache groups' blocks lie {sorted(strides)} bytes apart"
        )
    described = "|".join(f"{group.kind}:{group.engine.layout.name}" for group in groups)
    dense = KVLayout(
        LayoutKind.STATE,
        first.layout.num_blocks,
        first.layout.block_tokens,
        1,
        page,
        1,
        packing=f"pages-{hashlib.sha256(described.encode()).hexdigest()[:16]}",
    )
    stride = strides.pop()
    try:
        layout = dense if stride == page else attrs.evolve(dense, page_bytes=stride)
    except InvalidSpecError as exc:
        raise UnsupportedConfiguration(f"P/D of a hybrid SSM model: pages of {page} bytes, {exc}") from None
    return EngineSpec(
        model_id=model_id,
        kv_dtype="int8",
        num_layers=sum(len(group.layers) for group in groups),
        total_kv_heads=first.tp_size,
        layout=layout,
        tp_size=first.tp_size,
        window_tokens=layout.block_tokens,
    )


def _described(engine: EngineSpec) -> str:
    layout = engine.layout
    return (
        f"layout {layout.name} of {layout.block_tokens} tokens and {layout.block_bytes} bytes a block, "
        f"{engine.kv_dtype}, {engine.total_kv_heads} KV heads"
    )


_REFUSED_SPLITS = {
    "pipeline_parallel_size": "a stored chunk holds every layer of a rank, and a stage holds some",
    "decode_context_parallel_size": "a rank would hold some of a block's tokens",
    "prefill_context_parallel_size": "a rank would hold some of a block's tokens",
}
"""The parallel splits kvcore refuses, and why."""


def kv_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[KVGroup, ...]:
    """The model's KV-cache groups as kvcore sees them; raises ``UnsupportedConfiguration`` for what
    kvcore cannot key: local or sparse attention kinds, a hybrid SSM model whose groups have different
    block sizes, and the configurations ``kv_layout`` and ``state_layout`` refuse."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    parallel = vllm_config.parallel_config
    for name, why in _REFUSED_SPLITS.items():
        size = getattr(parallel, name, 1)
        if size != 1:
            raise UnsupportedConfiguration(
                f'kvcore does not support {name}={size} yet (only 1): {why} (docs/vllm.md, "Changing the '
                'parallel layout")'
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
    try:
        memory_order = cache.get_resolved_kv_cache_layout().name
    except ValueError as exc:  # vLLM resolves it in the engine core before connectors are built
        raise UnsupportedConfiguration(f"vLLM's KV cache layout is not resolved: {exc}") from None
    kinds = {
        FullAttentionSpec: "full",
        MLAAttentionSpec: "mla",
        SlidingWindowSpec: "sliding_window",
        MambaSpec: "mamba",
    }
    groups = kv_cache_config.kv_cache_groups
    specs = [group.kv_cache_spec for group in groups]
    for group, spec in zip(groups, specs, strict=True):
        if type(spec) not in kinds:
            raise UnsupportedConfiguration(
                f"kvcore's vLLM adapter keeps full attention, sliding-window attention and MLA KV and Mamba "
                f"states, not {type(spec).__name__} (layers {', '.join(group.layer_names[:3])}...)"
            )
        if not group.enable_kv_transfer or group.is_eagle_group:
            raise UnsupportedConfiguration(
                "kvcore's vLLM adapter does not support KV-cache groups that are not transferable or hold "
                f"draft-model layers (layers {', '.join(group.layer_names[:3])}...)"
            )
    if any(isinstance(spec, MambaSpec) for spec in specs):
        if len({spec.block_size for spec in specs}) != 1:
            raise UnsupportedConfiguration(
                f"a hybrid SSM model whose KV-cache groups have block sizes {[s.block_size for s in specs]}: "
                "kvcore keeps Mamba states where every group has one block size (vLLM's align mode)"
            )
        _check_states(vllm_config, kv_cache_config.hash_block_size, specs[0].block_size)
    model_id = model_identity(vllm_config)
    tp_size = parallel.tensor_parallel_size
    engines = []
    for group, spec in zip(groups, specs, strict=True):
        stride = _block_stride(kv_cache_config, group.layer_names)
        if isinstance(spec, MambaSpec):
            engines.append(
                EngineSpec(
                    model_id=model_id,
                    kv_dtype="int8",  # vLLM's raw view of the state bytes
                    num_layers=len(group.layer_names),
                    total_kv_heads=1 if spec.tp_replicated else tp_size,  # a rank's shard as one "head"
                    layout=state_layout(spec, kv_cache_config.num_blocks, block_stride=stride),
                    tp_size=tp_size,
                    window_tokens=spec.block_size,
                )
            )
            continue
        assert isinstance(spec, (FullAttentionSpec, SlidingWindowSpec))  # checked above, for mypy
        backend = attention_backend(vllm_config, list(group.layer_names))
        packing = ""
        if backend == CPU_BACKEND:
            packing = cpu_packing(model.dtype, spec.block_size, spec.head_size, cache.cache_dtype)
        layout = kv_layout(
            backend,
            memory_order,
            spec,
            kv_cache_config.num_blocks,
            packing=packing,
            block_stride=stride,
        )
        engines.append(
            EngineSpec(
                model_id=model_id,
                kv_dtype=kv_dtype(cache.cache_dtype, spec.dtype),
                num_layers=len(group.layer_names),
                total_kv_heads=1
                if isinstance(spec, MLAAttentionSpec)
                else _total_heads(spec.num_kv_heads, model.get_total_num_kv_heads(), tp_size),
                layout=layout,
                tp_size=tp_size,
                window_tokens=spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
            )
        )
    out = []
    for n, (group, spec, engine) in enumerate(zip(groups, specs, engines, strict=True)):
        kind = kinds[type(spec)]
        window = engine.window_tokens
        if len(groups) > 1 or window is not None:
            layers = hashlib.sha256("\0".join(group.layer_names).encode()).hexdigest()[:16]
            named = f"{engine.model_id}#kv-group={kind}{'' if window is None else window}/{layers}"
            siblings = sum(
                -(-other.host_block_bytes * spec.block_size // other.layout.block_tokens)  # the same tokens
                for m, other in enumerate(engines)
                if m != n
            )
            engine = attrs.evolve(engine, model_id=named, sibling_block_bytes=siblings)
        out.append(KVGroup(n, kind, window, tuple(group.layer_names), engine))
    return tuple(out)


def _total_heads(per_rank: int, model_total: int, tp_size: int) -> int:
    """A group's KV heads over every rank: the model's, unless the group's layers hold another count (a
    model whose full attention layers have KV heads of their own, as Gemma 4's may): then its heads on
    each rank times the ranks."""
    return model_total if per_rank == max(1, model_total // tp_size) else per_rank * tp_size


def _check_states(vllm_config: VllmConfig, hash_block: int | None, block_size: int) -> None:
    """Refuse what makes a Mamba group's block hold another state than the one after its last token:
    speculative decoding (rejected drafts roll the computed tokens back over states already written; a
    ReplaySSM model declares no speculative blocks), and a prefix-cache hash block smaller than the block
    (vLLM then copies partial states on write)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None or vllm_config.cache_config.use_replayssm:
        raise UnsupportedConfiguration(
            "a hybrid SSM model with speculative decoding (speculative_config, use_replayssm): kvcore keeps "
            "Mamba states without it"
        )
    if hash_block not in (None, block_size):
        raise UnsupportedConfiguration(
            f"a hybrid SSM model with hash_block_size={hash_block}: kvcore keeps Mamba states with vLLM's "
            f"prefix-cache hash block equal to its block size {block_size}"
        )


def _block_stride(kv_cache_config: KVCacheConfig, layers: list[str]) -> int | None:
    """The bytes between two blocks of a layer of ``layers``, as vLLM allocated them (``None`` where its
    config places no tensor for them). Every layer of a group has the same; ``EngineKV`` checks the
    views against it."""
    strides = {t.block_stride for t in kv_cache_config.kv_cache_tensors if set(t.layers) & set(layers)}
    if len(strides) > 1:
        raise UnsupportedConfiguration(
            f"layers {', '.join(layers[:3])}... have blocks {sorted(strides)} bytes apart: kvcore needs one "
            "block stride for the layers of a KV-cache group"
        )
    return strides.pop() if strides else None


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
