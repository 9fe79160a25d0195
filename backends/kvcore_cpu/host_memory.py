"""Host memory for KV blocks: one flat byte buffer of exactly the size asked for.

When the engine runs on CUDA the buffer is page-locked by registering a plain allocation with the driver,
so that copies to and from the GPU run asynchronously at full speed. torch's pinned allocator is avoided
on purpose: it rounds every allocation up to a power of two, which would waste up to half of a
many-gigabyte pool.
"""

from __future__ import annotations

from types import TracebackType

import torch

from kvcore.checks import COUNT, SIZE_LIMIT, is_int_in
from kvcore.errors import BackendUnavailable, ConfigError, UnsupportedConfiguration

__all__ = ["HostMemory"]


def _register(buffer: torch.Tensor) -> None:
    # torch.cuda.cudart() is untyped: it returns the pybind module of the CUDA runtime.
    runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    code = int(runtime.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    if code != 0:
        raise BackendUnavailable(f"cudaHostRegister of {buffer.numel()} bytes failed with CUDA error {code}")


def _pinned_for(device: object) -> bool:
    """Whether host memory for an engine on ``device`` is page-locked (CUDA). Raises ``ConfigError`` for
    a ``device`` that is not a ``torch.device``, ``UnsupportedConfiguration`` for CUDA without CUDA."""
    if not isinstance(device, torch.device):
        raise ConfigError("device", device, "a torch.device (the engine's)")
    if device.type != "cuda":
        return False
    if not torch.cuda.is_available():
        raise UnsupportedConfiguration(
            f"device: got {device}, but this torch has no usable CUDA device to page-lock memory for"
        )
    return True


def _is_byte_buffer(buffer: object) -> bool:
    return (
        isinstance(buffer, torch.Tensor)
        and buffer.device.type == "cpu"
        and buffer.dtype == torch.uint8
        and buffer.dim() == 1
        and buffer.is_contiguous()
    )


def _describe(value: object) -> str:
    """A tensor by dtype, shape and device (its repr would print its bytes); anything else by its type."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return type(value).__name__


def _unregister(buffer: torch.Tensor) -> None:
    runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # as in _register
    runtime.cudaHostUnregister(buffer.data_ptr())


class HostMemory:
    """``num_blocks`` host blocks of ``block_bytes`` each, in one contiguous uint8 buffer on the CPU.

    ``blocks`` views it as ``[num_blocks, block_bytes]``. ``close`` unregisters page-locked memory; the
    bytes stay readable until the last view is dropped, but a mover refuses closed host memory
    (``closed``). Use ``allocate`` or ``wrap``.
    """

    def __init__(self, buffer: torch.Tensor, num_blocks: int, block_bytes: int, pinned: bool) -> None:
        self.buffer = buffer
        self.blocks = buffer.view(num_blocks, block_bytes)
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.pinned = pinned
        self.closed = False

    @classmethod
    def allocate(cls, num_blocks: int, block_bytes: int, device: torch.device) -> HostMemory:
        """Allocate host blocks for an engine on ``device``; page-locked when ``device`` is CUDA.

        Raises ``ConfigError`` for a count that is not an int in ``[1, 2**62]`` (or a total above
        ``2**62`` bytes) or a ``device`` that is not a ``torch.device``, ``UnsupportedConfiguration`` for
        a CUDA device that this torch cannot use, ``BackendUnavailable`` when the machine cannot allocate
        the memory or the driver refuses to page-lock it (nothing stays allocated).
        """
        for name, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes)):
            if not is_int_in(value, 1, SIZE_LIMIT):
                raise ConfigError(name, value, COUNT)
        if num_blocks * block_bytes > SIZE_LIMIT:
            raise ConfigError("num_blocks", num_blocks, f"at most 2**62 bytes of {block_bytes}-byte blocks")
        pinned = _pinned_for(device)
        try:
            buffer = torch.empty(num_blocks * block_bytes, dtype=torch.uint8)
        # torch reports an allocation the machine cannot make as a RuntimeError.
        except RuntimeError as exc:
            raise BackendUnavailable(
                f"allocating {num_blocks * block_bytes} bytes of host memory: {exc}"
            ) from None
        if pinned:
            _register(buffer)
        return cls(buffer, num_blocks, block_bytes, pinned)

    @classmethod
    def wrap(cls, buffer: torch.Tensor, block_bytes: int, device: torch.device) -> HostMemory:
        """Host blocks over memory another owner maps here (an LMCache server's shared-memory pool): as
        many whole blocks as the uint8 ``buffer`` holds, page-locked when ``device`` is CUDA.

        Raises ``ConfigError`` for a ``buffer`` that is not a contiguous one-dimensional uint8 CPU tensor
        or holds not one block, or a ``block_bytes`` or ``device`` as ``allocate`` refuses them;
        ``UnsupportedConfiguration`` and ``BackendUnavailable`` as ``allocate``.
        """
        if not is_int_in(block_bytes, 1, SIZE_LIMIT):
            raise ConfigError("block_bytes", block_bytes, COUNT)
        if not _is_byte_buffer(buffer):
            raise ConfigError(
                "buffer", _describe(buffer), "a contiguous one-dimensional torch.uint8 CPU tensor"
            )
        num_blocks = buffer.numel() // block_bytes
        if num_blocks < 1:
            raise ConfigError("buffer", buffer.numel(), f"at least one block of {block_bytes} bytes")
        pinned = _pinned_for(device)
        blocks = buffer[: num_blocks * block_bytes]
        if pinned:
            _register(blocks)
        return cls(blocks, num_blocks, block_bytes, pinned)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def close(self) -> None:
        """Unpin the memory (if pinned) and mark it closed. Idempotent."""
        self.closed = True
        if self.pinned:
            self.pinned = False
            _unregister(self.buffer)

    def __enter__(self) -> HostMemory:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
