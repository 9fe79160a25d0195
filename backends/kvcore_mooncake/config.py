"""The Mooncake store's config class: ``{"kind": "mooncake_store", "master": ..., ...}``."""

from __future__ import annotations

from typing import ClassVar

from attrs import field, frozen

from kvcore.kit.settings import (
    ByteCount,
    ByteSize,
    fits_in_memory,
    host_and_port,
    one_of,
    seconds,
    within,
    word,
)

__all__ = ["MooncakeStoreConfig"]


@frozen
class MooncakeStoreConfig:
    """A Mooncake distributed store shared by engine instances, in front of a local host tier.

    ``local_size`` is the host memory (total across ranks) that stages every transfer and keeps recent
    chunks, as the CPU backend's ``size``; ``segment_size`` is what each worker contributes to the shared
    pool (0: a pure client, the pool lives in segment holders), ``transfer_buffer_size`` each worker's
    staging buffer inside Mooncake. One node holds at least ``local_size + segment_size +
    transfer_buffer_size`` (more with several workers): that sum must fit in this machine's physical
    memory. ``master`` is ``host:port``; ``devices`` may be empty (no RDMA devices named); ``replicas``
    (copies of each chunk, each in another segment) is at most 1024. ``rpc_timeout_s`` bounds each call to
    the master (Mooncake's ``MC_RPC_TIMEOUT_MS``, 30 s by its default): a master that is frozen or cut off
    fails each call after it, instead of holding every lookup, get and put for half a minute. Both
    timeouts lie in [0.001, 86400] seconds.
    """

    KIND: ClassVar[str] = "mooncake_store"
    HOST_FIELD: ClassVar[str] = "local_size"
    MOVES_BLOCKS: ClassVar[bool] = False
    REMOTE: ClassVar[bool] = True
    PER_HEAD: ClassVar[bool] = True  # one value per KV head: engines at every TP size share them
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ("local_size", "segment_size", "transfer_buffer_size")
    master: str = field(default="127.0.0.1:50051", validator=host_and_port)
    metadata: str = field(
        default="P2PHANDSHAKE", validator=word("'P2PHANDSHAKE' or a metadata server URL (no spaces)")
    )
    protocol: str = field(default="tcp", validator=one_of("tcp", "rdma"))
    devices: str = field(default="", validator=word("RDMA device names, comma-separated, or ''", r"\S*"))
    local_hostname: str = field(default="127.0.0.1", validator=word("a host name or address (no spaces)"))
    local_size: ByteSize = field(default=ByteSize(2**30), validator=fits_in_memory)
    segment_size: ByteCount = field(default=ByteCount(2**30), validator=fits_in_memory)
    transfer_buffer_size: ByteSize = field(default=ByteSize(64 * 2**20), validator=fits_in_memory)
    replicas: int = field(default=1, validator=within(1, 1024, "a count from 1 to 1024"))
    setup_timeout_s: float = field(default=10.0, validator=seconds)
    rpc_timeout_s: float = field(default=5.0, validator=seconds)

    @property
    def host_bytes(self) -> int:
        """Host memory for the local pool (and staging), total across ranks."""
        return self.local_size
