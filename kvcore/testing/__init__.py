"""The conformance suite of kvcore's ports, and in-memory reference backends.

Importing this package needs neither pytest nor hypothesis: it holds the reference backends
(``kvcore.testing.memory``) and the capability protocols that harnesses declare
(``kvcore.testing.capabilities``). The suites are in one module per port and import pytest:
``kvcore.testing.index``, ``.mover``, ``.ordered``, ``.store``, ``.managed``, ``.blocks``, ``.peer``. A
backend's test module subclasses a suite and provides a harness; see ``docs/writing-a-backend.md``.
"""

from __future__ import annotations

from kvcore.testing.capabilities import (
    SupportsCapacity,
    SupportsFailureInjection,
    SupportsPinning,
    SupportsStall,
)
from kvcore.testing.memory import (
    POISON,
    InMemoryAddressSpace,
    InMemoryBlockMover,
    InMemoryBlockTransferTier,
    InMemoryChunkIndex,
    InMemoryChunkStore,
    InMemoryManagedTier,
    InMemoryPeerTransport,
    InMemoryStoreIndex,
)

__all__ = [
    "POISON",
    "InMemoryAddressSpace",
    "InMemoryBlockMover",
    "InMemoryBlockTransferTier",
    "InMemoryChunkIndex",
    "InMemoryChunkStore",
    "InMemoryManagedTier",
    "InMemoryPeerTransport",
    "InMemoryStoreIndex",
    "SupportsCapacity",
    "SupportsFailureInjection",
    "SupportsPinning",
    "SupportsStall",
]
