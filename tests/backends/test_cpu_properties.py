"""The CPU tier's public constructors over arbitrary arguments: a working object, or a UsageError naming the
argument. Never a TypeError, AttributeError, ZeroDivisionError, OverflowError or a RuntimeError from torch
or numpy, and a submitted job always ends.

Tensors stay tiny (a few blocks of a few bytes), so that each property runs in a few seconds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcore.errors import BackendUnavailable, UsageError
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.ports import BlockTransfer, Direction
from kvcore_cpu.engine_kv import EngineKV
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.mover import TorchBlockMover

SETTLE = 10.0
CPU = torch.device("cpu")

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.integers(-2, 4), max_size=3),
    st.just(torch.zeros(3)),
    st.just(np.zeros(3)),
)


@st.composite
def either(draw: st.DrawFn, good: st.SearchStrategy[Any]) -> Any:
    """Mostly ``good``, one time in eight anything (hypothesis leans towards the first, valid choice)."""
    return draw(anything) if draw(st.integers(0, 7)) == 7 else draw(good)


def assert_names_one_of(exc: UsageError, names: tuple[str, ...]) -> None:
    assert any(name in str(exc) for name in names), str(exc)


def assert_out_of_memory(exc: BackendUnavailable, num_blocks: object, block_bytes: object) -> None:
    """A refusal of valid counts says what could not be allocated, and only a size no test machine has."""
    assert isinstance(num_blocks, int)
    assert isinstance(block_bytes, int)
    assert num_blocks * block_bytes > 1 << 30, str(exc)
    assert f"allocating {num_blocks * block_bytes} bytes of host memory" in str(exc)


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    kind = draw(st.sampled_from(list(LayoutKind)))
    heads = 1 if kind in (LayoutKind.MLA, LayoutKind.STATE) else draw(st.sampled_from([1, 2]))
    order = HeadOrder.HND if kind is LayoutKind.VLLM_CPU else draw(st.sampled_from(list(HeadOrder)))
    return KVLayout(
        kind, draw(st.integers(1, 3)), draw(st.integers(1, 2)), heads, draw(st.integers(1, 3)), 2, order
    )


DTYPES = [torch.bfloat16, torch.float16, torch.int16, torch.float32, torch.uint8, torch.complex64]


def rarely(draw: st.DrawFn) -> bool:
    """True one time in eight."""
    return draw(st.integers(0, 7)) == 7


@st.composite
def tensor_for(draw: st.DrawFn, layout: KVLayout) -> object:
    """A tensor that fits ``layout`` in one of its two forms, or, now and then, one whose shape, dtype,
    device, strides or kind is bent."""
    memory = torch.zeros(layout.physical_shape, dtype=torch.bfloat16)
    if not rarely(draw):
        return memory.transpose(2, 3) if len(layout.shape) == 5 and draw(st.booleans()) else memory
    shape = draw(st.sampled_from([layout.shape, layout.physical_shape, (*layout.shape[:-1], 7), (2, 2)]))
    dtype = draw(st.sampled_from(DTYPES))
    device = draw(st.sampled_from(["cpu", "meta"]))
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    bend = draw(st.sampled_from(["none", "transpose", "stride", "sparse", "conj", "numpy"]))
    if bend == "transpose" and tensor.dim() >= 4:
        return tensor.transpose(2, 3)
    if bend == "stride":
        return torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=dtype, device=device)[..., ::2]
    if bend == "sparse" and device == "cpu" and dtype is not torch.complex64:
        return tensor.to_sparse()
    if bend == "conj" and dtype is torch.complex64:
        return tensor.conj()
    if bend == "numpy" and device == "cpu" and dtype is not torch.bfloat16:
        return tensor.numpy()
    return tensor


@st.composite
def registrations(draw: st.DrawFn) -> tuple[object, object, object]:
    layout = draw(layouts())
    count = 0 if rarely(draw) else draw(st.integers(1, 3))
    tensors = [draw(tensor_for(layout)) for _ in range(count)]
    given_tensors = draw(either(st.sampled_from([tensors, tuple(tensors)])))
    given_layout = draw(either(st.just(layout)))
    kv_dtype = draw(either(st.sampled_from([None, "bfloat16", "bfloat16", "float16"])))
    return given_tensors, given_layout, kv_dtype


@settings(max_examples=200, deadline=None)
@given(args=registrations())
def test_register_gives_byte_views_or_refuses_by_name(args: tuple[object, object, object]) -> None:
    tensors, layout, kv_dtype = args
    try:
        kv = EngineKV.register(tensors, layout, kv_dtype=kv_dtype)  # type: ignore[arg-type]
    except UsageError as exc:
        assert_names_one_of(exc, ("layer", "tensors", "layout"))
        return
    assert isinstance(layout, KVLayout)
    assert kv.device == CPU
    for plane in kv.planes:
        assert plane.dtype == torch.uint8
        assert tuple(plane.shape) == (layout.num_blocks, kv.plane_bytes)
        assert plane.is_contiguous()
    assert kv.host_block_bytes * layout.num_blocks == layout.nbytes * kv.num_layers


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=either(st.integers(1, 16)),
    block_bytes=either(st.integers(1, 64)),
    device=either(st.sampled_from([CPU, torch.device("meta")])),
)
@example(num_blocks=1, block_bytes=1 << 50, device=CPU)  # valid, but no machine has a PiB to give
def test_allocate_gives_the_size_asked_for_or_refuses_by_name(
    num_blocks: object, block_bytes: object, device: object
) -> None:
    try:
        host = HostMemory.allocate(num_blocks, block_bytes, device)  # type: ignore[arg-type]
    except UsageError as exc:
        assert_names_one_of(exc, ("num_blocks", "block_bytes", "device"))
        return
    except BackendUnavailable as exc:  # a valid size beyond what this machine can allocate
        assert_out_of_memory(exc, num_blocks, block_bytes)
        return
    assert host.blocks.shape == (num_blocks, block_bytes)
    assert host.nbytes == host.buffer.untyped_storage().nbytes()
    host.close()


BLOCK_IDS = either(st.integers(0, 3)) | st.integers(0, 3).map(np.int64)
"""Mostly ids of blocks that exist; now and then anything (a float, a bool, a string, a huge int)."""


@st.composite
def transfers(draw: st.DrawFn) -> object:
    """A BlockTransfer of arbitrary ids (built through its constructor, which may refuse them itself)."""
    count = draw(st.integers(0, 4))
    engine: list[Any] = draw(st.lists(BLOCK_IDS, min_size=count, max_size=count))
    host_count = count + 1 if rarely(draw) else count
    host: list[Any] = draw(st.lists(BLOCK_IDS, min_size=host_count, max_size=host_count))
    direction = draw(either(st.sampled_from(list(Direction))))
    try:
        return BlockTransfer(direction, engine, host)
    except UsageError:
        return draw(anything)


@pytest.fixture(scope="module")
def engine() -> EngineKV:
    layout = KVLayout(LayoutKind.FLASH_ATTN, 4, block_tokens=2, num_kv_heads=1, head_size=2, dtype_size=2)
    return EngineKV.register([torch.zeros(layout.shape, dtype=torch.int16) for _ in range(2)], layout)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_mover_is_built_or_refused_and_every_job_it_takes_ends(
    engine: EngineKV, data: st.DataObject
) -> None:
    host_blocks = data.draw(st.integers(1, 6))
    host_bytes = data.draw(st.sampled_from([engine.host_block_bytes, engine.host_block_bytes + 1]))
    host = HostMemory.allocate(host_blocks, host_bytes, CPU)
    args = (
        data.draw(either(st.just(engine))),
        data.draw(either(st.just(host))),
        data.draw(either(st.integers(1, 3))),
    )
    try:
        mover = TorchBlockMover(args[0], args[1], copy_threads=args[2])
    except UsageError as exc:
        assert_names_one_of(exc, ("engine", "host", "copy_threads"))
        return
    try:
        for _ in range(3):
            transfer = data.draw(transfers())
            try:
                job = mover.submit(transfer)  # type: ignore[arg-type]
            except UsageError as exc:
                assert_names_one_of(exc, ("transfer", "direction", "engine_blocks", "host_blocks"))
                continue
            (result,) = mover.wait([job], SETTLE)
            assert result.ok, result
    finally:
        mover.close()
