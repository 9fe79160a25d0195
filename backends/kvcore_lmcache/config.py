"""The LMCache server's config class: ``{"kind": "lmcache_mp", "url": ..., ...}``."""

from __future__ import annotations

from typing import ClassVar

from attrs import field, frozen

from kvcore.kit.settings import ByteCount, fits_in_memory, one_of, seconds, within, word

__all__ = ["LMCacheMPConfig"]


@frozen
class LMCacheMPConfig:
    """A standalone LMCache multiprocess server, driven by the engine through shared-memory slots.

    ``lock_handover_s``: how long after its lookup the scheduler may hand that lookup's read locks to
    the workers, whose retrieve then needs no lookup of its own (older ones are released and the workers
    look up again); at most 240, under the server's default read-lock TTL (``--l1-read-ttl-seconds``,
    300; a server run with a shorter TTL needs a shorter hand-over). 0 turns the hand-over off.

    ``local_size`` 0 (the default): no local tier; the engine's blocks are copied straight into and out
    of the server's slots, whose memory is the node's host tier. A positive size keeps a host pool of the
    worker's in front of the server (hits there skip the server), through which every chunk is staged; it
    must fit in this machine's physical memory. ``url`` is a ZeroMQ endpoint (``tcp://host:port``,
    ``ipc://path``); the timeouts and the heartbeat lie in [0.001, 86400] seconds.
    """

    KIND: ClassVar[str] = "lmcache_mp"
    HOST_FIELD: ClassVar[str] = "local_size"
    MOVES_BLOCKS: ClassVar[bool] = True
    REMOTE: ClassVar[bool] = True
    PER_HEAD: ClassVar[bool] = True
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ("local_size",)
    url: str = field(
        default="tcp://localhost:5555",
        validator=word("a ZeroMQ endpoint such as 'tcp://localhost:5555'", r"[A-Za-z][A-Za-z0-9+.-]*://\S+"),
    )
    transfer_mode: str = field(default="engine_driven", validator=one_of("engine_driven"))
    request_timeout_s: float = field(default=5.0, validator=seconds)
    heartbeat_s: float = field(default=30.0, validator=seconds)
    connect_timeout_s: float = field(default=1.0, validator=seconds)
    lock_handover_s: float = field(default=60.0, validator=within(0.0, 240.0, "seconds, 0 (off) to 240"))
    local_size: ByteCount = field(default=ByteCount(0), validator=fits_in_memory)

    @property
    def host_bytes(self) -> int:
        """Host memory for the local pool (and staging), total across ranks."""
        return self.local_size
