"""vLLM 0.32's KV caches as kvcore layouts, for every attention backend whose bytes kvcore can describe.

vLLM hands a connector one view per layer, logically ``[blocks, heads, block_tokens, C]``, whose memory
order is the engine's resolved ``KVCacheLayout`` (one for the whole model) and whose ``C`` depends on the
backend:

- FlashAttention, FlashInfer, Triton and FlexAttention: ``C`` is a head's K then its V for one token
  (``LayoutKind.PAGED``), in memory order LBNHC (NHD, vLLM's default) or LBHNC (HND), or their
  cross-layer forms BLNHC and BLHNC (a block holds every layer's page: the layer's block stride, taken
  from vLLM's ``KVCacheTensor``, spans them; the bytes of a layer's block are the same as in LB*);
- CPU attention: LBHNC, and each head's ``block_tokens * C`` elements are its K then its V, packed in
  an order set by the attention ISA (``LayoutKind.VLLM_CPU``, the ISA as ``packing``);
- MLA: one latent per token, ``heads`` = 1 (``LayoutKind.MLA``; every rank holds the same bytes);
- a Mamba layer's state (hybrid SSM models, in vLLM's "align" cache mode): one raw int8 view
  ``[blocks, 1, 1, state bytes]`` whose page is padded to the attention page (``LayoutKind.STATE``,
  ``state_layout``; the state's kind, shapes and dtypes as ``packing``).

Refused at start-up, with a message naming what and why: another backend, another memory order
(BHLNC, where a layer's heads are apart; LHBNC), K and V of different sizes, and cache dtypes that carry
scales or packed values inside the page (per-token-head, NVFP4, TurboQuant, ...). A cache is named by the
dtype of its pages (``kv_dtype``), never by the model's: vLLM allocates a ``float16`` cache for a bf16
model. fp8 caches are stored as bytes by vLLM; kvcore names them by their fp8 format, so that e4m3 and
e5m2 never share keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from kvcore.errors import InvalidSpecError, UnsupportedConfiguration
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.state_plan import StateLayout, StatePart

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

__all__ = [
    "CPU_BACKEND",
    "MLA_BACKENDS",
    "PAGED_BACKENDS",
    "connector_views",
    "cpu_packing",
    "kv_dtype",
    "kv_layout",
    "page_views",
    "requested_order",
    "state_layout",
    "state_parts",
]

PAGED_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
"""GPU backends whose caches are ``LayoutKind.PAGED`` (K then V per head and token)."""

CPU_BACKEND = "CPU_ATTN"

MLA_BACKENDS = (
    "CPU_MLA",
    "AMX_MLA",
    "TRITON_MLA",
    "FLASHMLA",
    "FLASH_ATTN_MLA",
    "CUTLASS_MLA",
    "FLASHINFER_MLA",
)
"""Dense MLA backends: one latent per token, ``[blocks, 1, block_tokens, latent]`` (``LayoutKind.MLA``);
AMX_MLA packs its weights, not the cache. The sparse (indexer) backends keep more than the latent."""

_HEAD_ORDERS = {
    "LBNHC": HeadOrder.NHD,
    "LBHNC": HeadOrder.HND,
    "BLNHC": HeadOrder.NHD,
    "BLHNC": HeadOrder.HND,
}
"""The memory orders kvcore describes, by vLLM's ``KVCacheLayout`` name, and the order of a layer's block."""


def requested_order(use_mla: bool) -> str | None:
    """What kvcore's connectors ask vLLM for (``get_required_kvcache_layout``): LBHNC, where each head's
    bytes of a block are one run, so heterogeneous TP moves one range per head group instead of one per
    token (NHD is refused there), and one order on every backend that takes it lets engines with
    different defaults share keys (the order is part of them). Not the cross-layer BLHNC, although a run
    of its blocks is one copy each way: vLLM refuses to start with a cross-layer order where it splits a
    block into smaller kernel blocks (``create_kv_cache_views``), which a connector cannot foresee when it
    asks; kvcore describes BL* where vLLM resolves it (``VLLM_KV_CACHE_LAYOUT``, a backend that needs it).
    vLLM drops the request, with a warning, where a backend does not take LBHNC (FlexAttention: LBNHC
    only). MLA: nothing (one latent head, every order the same bytes)."""
    return None if use_mla else "LBHNC"


_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_UNQUANTIZED = ("auto", "float16", "bfloat16", "float32", "half", "float")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def kv_dtype(cache_dtype: str, page_dtype: torch.dtype) -> str:
    """The name of what the pages hold (an ``EngineSpec.kv_dtype``, part of every key): ``page_dtype``,
    the dtype vLLM allocated the cache in (its ``AttentionSpec.dtype``, which it resolves from
    ``kv_cache_dtype`` with ``kv_cache_dtype_str_to_dtype``: the model's dtype for ``auto``, the named
    one otherwise, so a bf16 model's ``float16`` cache holds float16), or, for an fp8 cache (bytes to
    vLLM), its fp8 format. Never the model's dtype: two engines whose pages hold different bytes for
    the same tokens must never share keys.

    Raises ``UnsupportedConfiguration`` for a cache dtype whose pages hold more than plain values, or
    an unquantised one whose pages are not floats."""
    if cache_dtype in _FP8:
        return _FP8[cache_dtype]
    if cache_dtype not in _UNQUANTIZED:
        raise UnsupportedConfiguration(
            f"kv_cache_dtype={cache_dtype!r}: kvcore cannot describe its pages (scales or packed values "
            f"inside them); supported: {', '.join((*_UNQUANTIZED, *_FP8))}"
        )
    if page_dtype not in _FLOATS:
        raise UnsupportedConfiguration(
            f"kv_cache_dtype={cache_dtype!r} with pages of {page_dtype}: kvcore expected pages of one of "
            f"{', '.join(str(d) for d in _FLOATS)}"
        )
    return str(page_dtype).removeprefix("torch.")


def kv_layout(
    backend: str,
    memory_order: str,
    spec: AttentionSpec,
    num_blocks: int,
    *,
    packing: str = "",
    block_stride: int | None = None,
) -> KVLayout:
    """The layout of one layer of ``spec`` under attention ``backend`` (``AttentionBackend.get_name()``)
    and the resolved ``KVCacheLayout`` name ``memory_order``; ``packing`` is the CPU attention ISA and
    ``block_stride`` the bytes between two blocks of a layer as vLLM allocated them (its
    ``KVCacheTensor.block_stride``; ``None``: the spec's page, padded or not).

    Raises ``UnsupportedConfiguration`` naming the backend, order or spec field kvcore cannot describe."""
    if spec.num_head_slots not in (None, spec.num_kv_heads) or spec.state_content_bytes is not None:
        raise UnsupportedConfiguration(
            f"{type(spec).__name__} with num_head_slots={spec.num_head_slots}, state_content_bytes="
            f"{spec.state_content_bytes}: a page holding more than K and V values is not described by kvcore"
        )
    if memory_order not in _HEAD_ORDERS:
        raise UnsupportedConfiguration(
            f"KV cache layout {memory_order}: kvcore describes {', '.join(_HEAD_ORDERS)} (unset "
            "VLLM_KV_CACHE_LAYOUT, or set it to one of these)"
        )
    head_size_v = getattr(spec, "head_size_v", spec.head_size)
    if backend in MLA_BACKENDS:
        if spec.num_kv_heads != 1 or head_size_v != 0:
            raise UnsupportedConfiguration(
                f"{backend} with num_kv_heads={spec.num_kv_heads}, head_size_v={head_size_v}: expected one "
                "latent per token (1 and 0)"
            )
        kind, order = LayoutKind.MLA, HeadOrder.HND  # one head: both orders are the same bytes
    elif head_size_v != spec.head_size:
        raise UnsupportedConfiguration(
            f"head_size_v={head_size_v} differs from head_size={spec.head_size}: kvcore describes K and V "
            "of one size"
        )
    elif backend == CPU_BACKEND:
        if memory_order != "LBHNC":  # vLLM's CPU attention reads nothing else
            raise UnsupportedConfiguration(f"{backend} with KV cache layout {memory_order}: expected LBHNC")
        kind, order = LayoutKind.VLLM_CPU, HeadOrder.HND
    elif backend in PAGED_BACKENDS:
        kind, order = LayoutKind.PAGED, _HEAD_ORDERS[memory_order]
    else:
        raise UnsupportedConfiguration(
            f"attention backend {backend}: kvcore describes the caches of "
            f"{', '.join((*PAGED_BACKENDS, CPU_BACKEND, *MLA_BACKENDS))}"
        )
    dense = KVLayout(
        kind,
        num_blocks,
        spec.block_size,
        spec.num_kv_heads,
        spec.head_size,
        torch.empty((), dtype=spec.dtype).element_size(),
        order,
        packing,
    )
    stride = spec.page_size_padded if block_stride is None else block_stride
    return _paged(dense, stride, memory_order)


STATE_KINDS = ("GDN_ATTN",)
"""The Mamba layer kinds (vLLM's ``MambaAttentionBackendEnum``) whose states kvcore keeps: those whose
"align" mode it was built and tested against (a block holds the state after its last token wherever the
request's computation stopped there)."""


def state_layout(spec: MambaSpec, num_blocks: int, *, block_stride: int | None = None) -> KVLayout:
    """The layout of one Mamba layer of ``spec`` on one rank: its state bytes at the start of each page.

    Refused (``UnsupportedConfiguration``, naming the field): a cache mode other than "align" (vLLM keeps
    no state per block then), speculative or prefill-checkpoint blocks (states at other places than the
    blocks' ends), and kinds outside ``STATE_KINDS``."""
    kind = spec.mamba_type.name
    checks = (
        (
            "mamba_cache_mode",
            spec.mamba_cache_mode,
            spec.mamba_cache_mode == "align",
            "'align' (prefix caching)",
        ),
        ("num_speculative_blocks", spec.num_speculative_blocks, not spec.num_speculative_blocks, "0"),
        (
            "num_prefill_checkpoint_blocks",
            spec.num_prefill_checkpoint_blocks,
            not spec.num_prefill_checkpoint_blocks,
            "0",
        ),
        ("mamba_type", kind, kind in STATE_KINDS, " or ".join(STATE_KINDS)),
    )
    for name, got, ok, wanted in checks:
        if not ok:
            raise UnsupportedConfiguration(
                f"Mamba state with {name}={got!r}: kvcore keeps hybrid SSM states with {name} {wanted}"
            )
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    described = repr((kind, spec.shapes, spec.dtypes, spec.tp_replicated, get_conv_state_layout()))
    packing = f"{kind.lower()}-{hashlib.sha256(described.encode()).hexdigest()[:16]}"
    state = spec.state_content_size_bytes
    stride = spec.page_size_bytes if block_stride is None else block_stride
    dense = KVLayout(LayoutKind.STATE, num_blocks, spec.block_size, 1, state, 1, packing=packing)
    return _paged(dense, stride, "Mamba state")


def state_parts(spec: MambaSpec, tp_size: int) -> StateLayout:
    """How a Gated DeltaNet layer's state of ``spec`` (one rank's, at ``tp_size`` ranks) splits over TP
    ranks, for P/D between engines of different TP sizes.

    vLLM keeps a convolution state, then the recurrent state, from the start of each page. The convolution
    state's channels are a rank's Q, K and V channels one after another (``key_dim / TP`` twice, then
    ``value_dim / TP``: vLLM loads the convolution's weights that way), in vLLM's "SD" order (each of the
    ``kernel - 1`` time steps holds every channel) or "DS" (each channel holds every time step); the
    recurrent state is ``value_heads / TP`` heads of ``head_v x head_k``. The name covers the kind, the
    parts, the dtypes and the order: the same at every TP size (what the P/D handshake compares; the
    ``packing`` of ``state_layout``, which keys a tier's values, names a rank's shard and differs).

    Raises ``UnsupportedConfiguration`` for shapes that do not decompose so (another kind, or a state vLLM
    replicates over ranks)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    order = get_conv_state_layout()
    kind = spec.mamba_type.name
    shapes = [tuple(int(n) for n in shape) for shape in spec.shapes]
    refused = UnsupportedConfiguration(
        f"P/D of a {kind} state of shapes {spec.shapes} (tp_replicated={spec.tp_replicated}) between TP "
        "sizes: kvcore splits Gated DeltaNet states over ranks"
    )
    if (
        kind not in STATE_KINDS
        or spec.tp_replicated
        or [len(shape) for shape in shapes] != [2, 3]
        or len(spec.dtypes) != 2
    ):
        raise refused
    conv, temporal = shapes
    sizes = [torch.empty((), dtype=dtype).element_size() for dtype in spec.dtypes]
    channels, steps = conv if order == "DS" else conv[::-1]
    value = temporal[0] * temporal[1]
    if not 0 < value < channels or (channels - value) % 2:
        raise refused
    key = (channels - value) // 2
    channel_parts = [StatePart(n * tp_size, sizes[0]) for n in (key, key, value)]
    if order == "DS":
        convolution = [StatePart(part.units, steps * sizes[0]) for part in channel_parts]
    else:
        convolution = channel_parts * steps
    heads = StatePart(temporal[0] * tp_size, temporal[1] * temporal[2] * sizes[1])
    parts = [*convolution, heads]
    described = repr(
        (kind, order, [str(dtype) for dtype in spec.dtypes], [(p.units, p.unit_bytes) for p in parts])
    )
    state = StateLayout(f"{kind.lower()}-{hashlib.sha256(described.encode()).hexdigest()[:16]}", parts)
    if state.rank_bytes(tp_size) != spec.state_content_size_bytes:
        raise UnsupportedConfiguration(
            f"P/D of a {kind} state of shapes {spec.shapes}: its parts do not make its "
            f"{spec.state_content_size_bytes} bytes"
        )
    return state


def _paged(dense: KVLayout, stride: int | None, what: str) -> KVLayout:
    """``dense`` with its blocks ``stride`` bytes apart (``None``: dense), or ``UnsupportedConfiguration``
    naming ``what`` where the stride cannot hold a block."""
    if stride is None or stride == dense.block_bytes:
        return dense
    try:
        return attrs.evolve(dense, page_bytes=stride)
    except InvalidSpecError as exc:
        raise UnsupportedConfiguration(f"{what} with blocks {stride} bytes apart: {exc}") from None


def cpu_packing(model_dtype: torch.dtype, block_tokens: int, head_size: int, cache_dtype: str) -> str:
    """The ISA vLLM's CPU attention packs each head's K and V for (``amx``, ``vec``, ``vec16``, ...): the
    same choice vLLM makes, so that caches of two CPUs that pack differently never share keys."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(model_dtype, block_tokens, head_size, cache_dtype))


def page_views(
    kv_caches: Mapping[str, torch.Tensor], layers: Sequence[str], engine: EngineSpec
) -> list[torch.Tensor]:
    """One raw int8 view of each layer's pages (``engine.layout``, ``engine_spec.page_engine``), from where
    vLLM's view of the layer starts, in the layers' order: layer ``i`` of each group of a hybrid SSM model
    views the same pages, each its own way, so a view is kept once per start. Raises ``InvalidSpecError``
    for a layer missing from ``kv_caches`` or memory that ends before the layer's last page."""
    missing = [name for name in layers if name not in kv_caches]
    if missing:
        raise InvalidSpecError(f"KV caches missing for layers {missing}")
    layout = engine.layout
    end = (layout.num_blocks - 1) * layout.block_stride + layout.head_size
    views: dict[int, torch.Tensor] = {}
    for name in layers:
        tensor = kv_caches[name]
        if tensor.data_ptr() in views:
            continue
        storage = tensor.untyped_storage()
        offset = tensor.data_ptr() - storage.data_ptr()
        if offset + end > storage.nbytes():
            raise InvalidSpecError(
                f"layer {name}: its memory ends {storage.nbytes() - offset} bytes past its start, expected "
                f"{layout.num_blocks} pages of {layout.head_size} bytes, {layout.block_stride} apart"
            )
        raw = torch.empty(0, dtype=torch.int8, device=tensor.device)
        views[tensor.data_ptr()] = raw.set_(storage, offset, layout.shape, layout.strides)
    return list(views.values())


def connector_views(
    kv_caches: Mapping[str, torch.Tensor], layers: Sequence[str], engine: EngineSpec
) -> list[torch.Tensor]:
    """vLLM's views of ``layers`` (in that order) as tensors of the engine's layout: kernel blocks
    regrouped into the manager's blocks (where the engine splits its blocks for the attention kernel),
    MLA's single-head axis dropped and fp8 bytes seen as their dtype. ``kvcore_cpu.EngineKV.register``
    then checks every one.

    Raises ``InvalidSpecError`` for a layer missing from ``kv_caches``, or a split whose kernel blocks do
    not continue each other's tokens (HND: a block's heads are then not contiguous)."""
    missing = [name for name in layers if name not in kv_caches]
    if missing:
        raise InvalidSpecError(f"KV caches missing for layers {missing}")
    layout, target = engine.layout, getattr(torch, engine.kv_dtype)
    views = []
    for layer, tensor in enumerate(kv_caches[name] for name in layers):
        view = tensor
        count = int(tensor.shape[0]) if tensor.dim() == 4 else layout.num_blocks
        if count != layout.num_blocks and count % layout.num_blocks == 0:
            ratio = count // layout.num_blocks
            blocks, heads, tokens, width = (int(n) for n in tensor.shape)
            s_block, s_head, s_token, s_elem = tensor.stride()
            if s_block != tokens * s_token:
                raise InvalidSpecError(
                    f"layer {layer}: kernel blocks of {tokens} tokens in blocks of {tokens * ratio} "
                    f"({layout.head_order.value.upper()}): a block's heads are not contiguous; use "
                    f"--block-size {tokens} or the LBNHC layout"
                )
            view = tensor.as_strided(
                (blocks // ratio, heads, tokens * ratio, width), (ratio * s_block, s_head, s_token, s_elem)
            )
        if layout.kind is LayoutKind.MLA and view.dim() == 4 and view.shape[1] == 1:
            view = view.squeeze(1)  # vLLM's [blocks, 1, block_tokens, latent]: one latent "head"
        if view.dtype != target and view.element_size() == target.itemsize:
            view = view.view(target)
        views.append(view)
    return views
