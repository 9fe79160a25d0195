"""The ports: what kvcore needs from the world outside, as ``typing.Protocol``s, by side. This module is
the contract a backend author reads; each port's docstring is its specification (the conformance suite,
``kvcore.testing``, checks what they say).

- ``kvcore.ports.common`` — the values both sides exchange, ``JobQueue`` (every asynchronous port) and
  ``SupportsClear``.
- ``kvcore.ports.scheduler_side`` — decides, indexes, never touches KV bytes: ``ChunkIndex``, its
  immediate form ``SupportsImmediateLookup``, ``SupportsHeldLookups`` (lookups whose read locks the
  workers' load takes over) and ``SupportsTierUsage``.
- ``kvcore.ports.stores`` — the remote tiers a backend implements: ``ChunkStore`` (content-addressed,
  filled and drained by the client), ``ManagedTier`` (its own memory and sessions), with
  ``SupportsBlockTransfer`` and ``SupportsAdoptedLocks``.
- ``kvcore.ports.worker_side`` — owns memory, executes jobs: ``BlockMover`` and ``OrderedMover`` (engine KV
  <-> host blocks), ``RemoteTier`` and ``BlockRemote`` (what a rank's worker drives beyond its pool; kvcore
  makes one of a ``ChunkStore`` or ``ManagedTier``), ``PeerTransport`` (prefill -> decode pushes), and
  ``RankMemory``/``BlockMovers`` (what a remote tier is opened over).

Every asynchronous method hands out a ``JobId``; results come back once through ``poll`` or ``wait``.
Each method says what state a failure leaves. Implementations map their native failures to
``kvcore.errors`` at their edge; nothing else may escape them. Every port that holds threads, sockets or
memory ends with ``close``: idempotent, it refuses new work and says what becomes of the work in flight.
"""

from __future__ import annotations

from kvcore.ports.common import (
    BlockItem,
    BlockTransfer,
    ByteCopy,
    Direction,
    HeldChunks,
    JobQueue,
    MemoryRegion,
    StoreItem,
    SupportsClear,
    TierUsage,
)
from kvcore.ports.scheduler_side import (
    ChunkIndex,
    SupportsHeldLookups,
    SupportsImmediateLookup,
    SupportsLookupProgress,
    SupportsTierUsage,
)
from kvcore.ports.stores import ChunkStore, ManagedTier, SupportsAdoptedLocks, SupportsBlockTransfer
from kvcore.ports.worker_side import (
    BlockMover,
    BlockMovers,
    BlockRemote,
    OrderedMover,
    PeerTransport,
    RankMemory,
    RemoteTier,
    SupportsDeviceOrder,
    SupportsReopen,
    SupportsWriteBack,
)

__all__ = [
    "BlockItem",
    "BlockMover",
    "BlockMovers",
    "BlockRemote",
    "BlockTransfer",
    "ByteCopy",
    "ChunkIndex",
    "ChunkStore",
    "Direction",
    "HeldChunks",
    "JobQueue",
    "ManagedTier",
    "MemoryRegion",
    "OrderedMover",
    "PeerTransport",
    "RankMemory",
    "RemoteTier",
    "StoreItem",
    "SupportsAdoptedLocks",
    "SupportsBlockTransfer",
    "SupportsClear",
    "SupportsDeviceOrder",
    "SupportsHeldLookups",
    "SupportsImmediateLookup",
    "SupportsReopen",
    "SupportsLookupProgress",
    "SupportsTierUsage",
    "SupportsWriteBack",
    "TierUsage",
]
