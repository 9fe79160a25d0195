"""The disk tier's config class: the keys of ``{"backend": {"kind": "disk", ...}}``."""

from __future__ import annotations

from typing import ClassVar

from attrs import field, frozen
from attrs.validators import instance_of

from kvcore.kit.settings import ByteSize, fits_in_memory, non_empty, within

__all__ = ["DiskConfig"]


@frozen
class DiskConfig:
    """Chunks as files under ``path`` (an existing, writable directory), at most ``size`` bytes of them,
    behind a host pool of ``local_size`` bytes (total across ranks) that keeps recent chunks and stages
    every file read and write. ``fsync`` flushes each file to the device before it becomes visible
    (chunks then survive a power loss, not only a crash); ``io_threads`` read and write the files of one
    job side by side. The path is checked when the engine starts: it must exist, be writable, hold no
    other format's chunks, and ``size`` must fit in its file system.
    """

    KIND: ClassVar[str] = "disk"
    HOST_FIELD: ClassVar[str] = "local_size"
    MOVES_BLOCKS: ClassVar[bool] = False  # every chunk is staged through the host pool
    REMOTE: ClassVar[bool] = True  # chunks live outside the engine: saves are published to the files
    PER_HEAD: ClassVar[bool] = True  # one file per KV head: engines at every TP size share them
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ("local_size",)
    path: str = field(validator=non_empty)
    size: ByteSize = field()
    local_size: ByteSize = field(default=ByteSize(2**30), validator=fits_in_memory)
    fsync: bool = field(default=False, validator=instance_of(bool))
    io_threads: int = field(default=4, validator=within(1, 64, "a count from 1 to 64"))

    @property
    def host_bytes(self) -> int:
        """Host memory for the local pool (and staging), total across ranks."""
        return self.local_size
