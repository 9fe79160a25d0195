"""Host memory for KV blocks: one flat byte buffer of exactly the size asked for.

When the engine runs on CUDA the buffer is page-locked by registering a plain allocation with the driver,
so that copies to and from the GPU run asynchronously at full speed. torch's pinned allocator is avoided
on purpose: it rounds every allocation up to a power of two, which would waste up to half of a
many-gigabyte pool.
"""

from __future__ import annotations

from types import TracebackType

import torch

from kvcore.errors import BackendUnavailable, ConfigError

__all__ = ["HostMemory"]


def _register(buffer: torch.Tensor) -> None:
    # torch.cuda.cudart() is untyped: it returns the pybind module of the CUDA runtime.
    runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    code = int(runtime.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    if code != 0:
        raise BackendUnavailable(f"cudaHostRegister of {buffer.numel()} bytes failed with CUDA error {code}")


def _unregister(buffer: torch.Tensor) -> None:
    runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # as in _register
    runtime.cudaHostUnregister(buffer.data_ptr())


class HostMemory:
    """``num_blocks`` host blocks of ``block_bytes`` each, in one contiguous uint8 buffer on the CPU.

    ``blocks`` views it as ``[num_blocks, block_bytes]``. ``close`` unregisters page-locked memory; the
    bytes stay readable until the last view is dropped. Use ``allocate``.
    """

    def __init__(self, buffer: torch.Tensor, num_blocks: int, block_bytes: int, pinned: bool) -> None:
        self.buffer = buffer
        self.blocks = buffer.view(num_blocks, block_bytes)
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.pinned = pinned

    @classmethod
    def allocate(cls, num_blocks: int, block_bytes: int, device: torch.device) -> HostMemory:
        """Allocate host blocks for an engine on ``device``; page-locked when ``device`` is CUDA.

        Raises ``ConfigError`` for a size below one, ``BackendUnavailable`` when the driver refuses to
        page-lock the memory (nothing stays allocated).
        """
        if num_blocks < 1:
            raise ConfigError("num_blocks", num_blocks, "at least 1")
        if block_bytes < 1:
            raise ConfigError("block_bytes", block_bytes, "at least 1")
        buffer = torch.empty(num_blocks * block_bytes, dtype=torch.uint8)
        pinned = device.type == "cuda"
        if pinned:
            _register(buffer)
        return cls(buffer, num_blocks, block_bytes, pinned)

    @classmethod
    def wrap(cls, buffer: torch.Tensor, block_bytes: int, device: torch.device) -> HostMemory:
        """Host blocks over memory another owner maps here (an LMCache server's shared-memory pool): as
        many whole blocks as the uint8 ``buffer`` holds, page-locked when ``device`` is CUDA.

        Raises ``ConfigError`` when not one block fits, ``BackendUnavailable`` as ``allocate``.
        """
        num_blocks = buffer.numel() // block_bytes if block_bytes > 0 else 0
        if num_blocks < 1:
            raise ConfigError("buffer", buffer.numel(), f"at least one block of {block_bytes} bytes")
        blocks = buffer[: num_blocks * block_bytes]
        pinned = device.type == "cuda"
        if pinned:
            _register(blocks)
        return cls(blocks, num_blocks, block_bytes, pinned)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def close(self) -> None:
        """Unpin the memory (if pinned). Idempotent."""
        if self.pinned:
            self.pinned = False
            _unregister(self.buffer)

    def __enter__(self) -> HostMemory:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
