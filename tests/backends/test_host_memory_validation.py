"""HostMemory refuses sizes, buffers and devices it cannot hold blocks in, naming the argument."""

from __future__ import annotations

import re

import pytest
import torch

from kvcore.errors import BackendUnavailable, ConfigError, UnsupportedConfiguration
from kvcore_cpu.host_memory import HostMemory

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["num_blocks", "block_bytes"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True, "4", None, 2**62 + 1], ids=repr)
def test_sizes_are_ints_in_range(name: str, value: object) -> None:
    sizes: dict[str, object] = {"num_blocks": 4, "block_bytes": 64, name: value}
    with pytest.raises(
        ConfigError, match=rf"^{name}: got {re.escape(repr(value))}, expected an int in \[1, 2\*\*62\]"
    ):
        HostMemory.allocate(sizes["num_blocks"], sizes["block_bytes"], CPU)  # type: ignore[arg-type]


def test_a_total_above_2_62_bytes_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"^num_blocks: got 4611686018427387904, expected at most 2\*\*62 bytes"
    ):
        HostMemory.allocate(2**62, 2, CPU)


def test_memory_the_machine_cannot_allocate_is_unavailable() -> None:
    # 2**61 bytes is within bounds but beyond any address space: torch's RuntimeError becomes a backend error
    with pytest.raises(BackendUnavailable, match=r"allocating 2305843009213693952 bytes of host memory"):
        HostMemory.allocate(2**30, 2**31, CPU)


@pytest.mark.parametrize("device", ["cpu", None, 0], ids=repr)
def test_the_device_is_a_torch_device(device: object) -> None:
    with pytest.raises(
        ConfigError, match=rf"^device: got {re.escape(repr(device))}, expected a torch.device"
    ):
        HostMemory.allocate(4, 64, device)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_page_locking_for_cuda_without_cuda_is_unsupported() -> None:
    with pytest.raises(
        UnsupportedConfiguration, match=r"device: got cuda, but this torch has no usable CUDA"
    ):
        HostMemory.allocate(4, 64, torch.device("cuda"))
    with pytest.raises(UnsupportedConfiguration, match=r"device: got cuda"):
        HostMemory.wrap(torch.zeros(256, dtype=torch.uint8), 64, torch.device("cuda"))


@pytest.mark.parametrize(
    ("buffer", "got"),
    [
        (torch.zeros(64, dtype=torch.float32), "torch.float32 tensor of shape (64,) on cpu"),
        (torch.zeros(4, 64, dtype=torch.uint8), "torch.uint8 tensor of shape (4, 64) on cpu"),
        (torch.zeros(512, dtype=torch.uint8)[::2], "torch.uint8 tensor of shape (256,) on cpu"),
        (bytearray(256), "bytearray"),
    ],
    ids=["float", "2-d", "strided", "bytearray"],
)
def test_wrap_takes_a_flat_contiguous_byte_tensor(buffer: object, got: str) -> None:
    with pytest.raises(ConfigError, match=rf"^buffer: got {re.escape(repr(got))}, expected a contiguous"):
        HostMemory.wrap(buffer, 64, CPU)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_bytes", [0, -64, 64.0], ids=repr)
def test_wrap_names_block_bytes_when_it_is_wrong(block_bytes: object) -> None:
    with pytest.raises(ConfigError, match=rf"^block_bytes: got {re.escape(repr(block_bytes))}"):
        HostMemory.wrap(torch.zeros(256, dtype=torch.uint8), block_bytes, CPU)  # type: ignore[arg-type]


def test_close_marks_the_memory_closed_and_is_idempotent() -> None:
    host = HostMemory.allocate(2, 8, CPU)
    assert not host.closed
    host.close()
    host.close()
    assert host.closed
