"""The CPU tier's config class: ``{"kind": "cpu", "size": ...}``."""

from __future__ import annotations

from typing import ClassVar

from attrs import field, frozen

from kvcore.kit.settings import ByteSize, fits_in_memory

__all__ = ["CPUBackendConfig"]


@frozen
class CPUBackendConfig:
    """The embedded default: a host-memory pool inside each worker, indexed by the scheduler.

    ``size`` is the total across all ranks of one engine, as vLLM's own offloading size is; it must fit in
    this machine's physical memory.
    """

    KIND: ClassVar[str] = "cpu"
    HOST_FIELD: ClassVar[str] = "size"
    MOVES_BLOCKS: ClassVar[bool] = False
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ("size",)
    REMOTE: ClassVar[bool] = False
    size: ByteSize = field(validator=fits_in_memory)

    @property
    def host_bytes(self) -> int:
        """Host memory for the local pool, total across ranks."""
        return self.size
