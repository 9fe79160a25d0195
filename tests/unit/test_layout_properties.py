"""KVLayout and EngineSpec over arbitrary arguments: a valid object, or a UsageError that names the field.

Never a TypeError, AttributeError, ZeroDivisionError or OverflowError from deeper down, and never an object
whose fields are not what their types say (a string where an enum belongs, a float where an int does).
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.checks import SIZE_LIMIT
from kvcore.errors import UsageError
from kvcore.model.engine import KV_DTYPE_SIZES, EngineSpec
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind

LAYOUT_FIELDS = (
    "kind",
    "num_blocks",
    "block_tokens",
    "num_kv_heads",
    "head_size",
    "dtype_size",
    "head_order",
    "packing",
    "page_bytes",
)
COUNT_FIELDS = ("num_blocks", "block_tokens", "num_kv_heads", "head_size", "dtype_size")
SPEC_FIELDS = ("model_id", "kv_dtype", "num_layers", "total_kv_heads", "layout", "tp_size", "window_tokens")

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=4),
    st.lists(st.integers(0, 4), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from([*LayoutKind, *HeadOrder]),
)
"""Values of every kind a caller might pass by mistake."""

counts = st.integers(1, 8)

AXES = {
    LayoutKind.VLLM_CPU: 4,
    LayoutKind.PAGED: 4,
    LayoutKind.FLASH_ATTN: 5,
    LayoutKind.FLASH_INFER: 5,
    LayoutKind.MLA: 3,
    LayoutKind.STATE: 4,
}


@st.composite
def _either(draw: st.DrawFn, good: st.SearchStrategy[Any]) -> Any:
    # one time in eight: hypothesis leans towards the simplest choice, which stays the valid one
    return draw(anything) if draw(st.integers(0, 7)) == 7 else draw(good)


def either(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value, sometimes anything."""
    return _either(good)


layout_args = st.fixed_dictionaries(
    {
        "kind": either(st.sampled_from([*LayoutKind, *(k.value for k in LayoutKind)])),
        "num_blocks": either(st.one_of(counts, st.integers(1, SIZE_LIMIT))),
        "block_tokens": either(counts),
        "num_kv_heads": either(st.sampled_from([1, 1, 2, 4])),
        "head_size": either(st.one_of(counts, st.integers(1, SIZE_LIMIT))),
        "dtype_size": either(st.sampled_from([1, 2, 4])),
        "head_order": either(st.sampled_from([*HeadOrder, *(o.value for o in HeadOrder)])),
        "packing": either(st.sampled_from(["", "amx", "vec16", "AMX", "a/b"])),
        "page_bytes": either(st.one_of(st.none(), st.integers(1, 1 << 12))),
    }
)


def assert_names_one_of(exc: UsageError, names: tuple[str, ...]) -> None:
    assert any(name in str(exc) for name in names), str(exc)


def assert_well_typed(layout: KVLayout) -> None:
    assert isinstance(layout.kind, LayoutKind)
    assert isinstance(layout.head_order, HeadOrder)
    for name in COUNT_FIELDS:
        value = getattr(layout, name)
        assert type(value) is int
        assert 1 <= value <= SIZE_LIMIT
    assert isinstance(layout.packing, str)
    assert layout.page_bytes is None or layout.block_bytes <= layout.page_bytes == layout.block_stride
    assert layout.nbytes <= SIZE_LIMIT


@settings(max_examples=300, deadline=None)
@given(args=layout_args)
def test_a_layout_is_well_typed_or_refused_by_field(args: dict[str, Any]) -> None:
    try:
        layout = KVLayout(**args)
    except UsageError as exc:
        assert_names_one_of(exc, LAYOUT_FIELDS)
        return
    assert_well_typed(layout)
    assert len(layout.shape) == AXES[layout.kind]


@st.composite
def small_layouts(draw: st.DrawFn) -> KVLayout:
    """A valid small layout of any kind (MLA, state: one head)."""
    kind = draw(st.sampled_from(list(LayoutKind)))
    heads = 1 if kind in (LayoutKind.MLA, LayoutKind.STATE) else draw(st.sampled_from([1, 2, 4]))
    order = HeadOrder.HND if kind is LayoutKind.VLLM_CPU else draw(st.sampled_from(list(HeadOrder)))
    return KVLayout(
        kind, draw(counts), draw(counts), heads, draw(counts), draw(st.sampled_from([1, 2, 4, 8])), order
    )


@st.composite
def spec_args(draw: st.DrawFn) -> dict[str, Any]:
    """Fields of a consistent spec, each sometimes replaced by a plausible but inconsistent value or by
    anything at all."""
    layout = draw(small_layouts())
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    heads = layout.num_kv_heads
    replicated = heads == 1 and draw(st.booleans())
    total = draw(st.sampled_from([d for d in (1, 2, 4, 8) if tp % d == 0])) if replicated else heads * tp
    dtypes = sorted(name for name, size in KV_DTYPE_SIZES.items() if size == layout.dtype_size)
    consistent: dict[str, Any] = {
        "model_id": "m",
        "kv_dtype": draw(st.sampled_from(dtypes)),
        "num_layers": draw(counts),
        "total_kv_heads": total,
        "layout": layout,
        "tp_size": tp,
        "window_tokens": layout.block_tokens if layout.kind is LayoutKind.STATE else None,
    }
    plausible: dict[str, st.SearchStrategy[Any]] = {
        "model_id": st.text(max_size=8),
        "kv_dtype": st.sampled_from(sorted(KV_DTYPE_SIZES)),
        "num_layers": st.integers(1, SIZE_LIMIT),
        "total_kv_heads": st.sampled_from([1, 2, 3, 4, 6, 8, 16]),
        "layout": small_layouts(),
        "tp_size": st.sampled_from([1, 2, 3, 4, 8]),
        "window_tokens": st.sampled_from([None, 1, 8, 64]),
    }
    return {
        name: draw(either(st.one_of(st.just(value), plausible[name]))) for name, value in consistent.items()
    }


@settings(max_examples=300, deadline=None)
@given(args=spec_args())
def test_an_engine_spec_is_consistent_or_refused_by_field(args: dict[str, Any]) -> None:
    try:
        engine = EngineSpec(**args)
    except UsageError as exc:
        assert_names_one_of(exc, SPEC_FIELDS)
        return
    assert isinstance(engine.model_id, str)
    assert engine.layout.dtype_size == KV_DTYPE_SIZES[engine.kv_dtype]
    assert_well_typed(engine.layout)
    heads, tp = engine.total_kv_heads, engine.tp_size
    if engine.layout.kind is LayoutKind.STATE:
        assert engine.window_tokens == engine.layout.block_tokens
    if engine.layout.kind is not LayoutKind.MLA:
        assert engine.layout.num_kv_heads * tp == heads if heads >= tp else engine.layout.num_kv_heads == 1
    assert engine.num_layers * engine.layout.nbytes <= SIZE_LIMIT
