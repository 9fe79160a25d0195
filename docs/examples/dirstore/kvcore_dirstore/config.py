"""The backend's config class: the keys of ``{"backend": {"kind": "dirstore", ...}}``."""

from __future__ import annotations

from typing import ClassVar

from attrs import field, frozen

from kvcore.kit.settings import ByteSize, fits_in_memory, non_empty

__all__ = ["DirStoreConfig"]


@frozen
class DirStoreConfig:
    """Chunks as files under ``path`` (a directory, created if missing), behind a host pool of
    ``local_size`` bytes (total across ranks) through which every chunk is staged."""

    KIND: ClassVar[str] = "dirstore"
    HOST_FIELD: ClassVar[str] = "local_size"
    MOVES_BLOCKS: ClassVar[bool] = False  # every chunk goes through the host pool
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ("local_size",)
    REMOTE: ClassVar[bool] = True  # chunks live outside the engine: saves are published to the files
    path: str = field(validator=non_empty)
    local_size: ByteSize = field(default=ByteSize(64 * 2**20), validator=fits_in_memory)

    @property
    def host_bytes(self) -> int:
        return self.local_size
