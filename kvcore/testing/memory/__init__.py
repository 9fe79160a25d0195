"""In-memory reference implementations of every port: simple, obviously right, and free of pytest.

They are the fakes that unit tests of the core hand in, and the executable reading of each port's
contract that the conformance suite is written against. Each also offers the test hooks of
``kvcore.testing.capabilities``: ``fail_next`` (the next items fail), ``stall`` (jobs stay in flight)
and, when built with one, a capacity.

Jobs run in submission order on a ``JobLane`` (``kvcore.kit.lane``), whose thread the first ``submit`` starts
and which ends once the backend is dropped: nothing runs at import or construction, and ``submit``
returns before anything is copied. ``close`` refuses new work as each port says; jobs queued before it
still run. Stalls and failures are ``InjectedFaults`` (``kvcore.testing.faults``),
the implementation every conformance harness shares. A failed item's destination is overwritten with
``POISON`` bytes ("undefined"), so that a caller that uses it anyway is caught by its own tests.
"""

from __future__ import annotations

from kvcore.testing.memory.common import POISON
from kvcore.testing.memory.index import InMemoryChunkIndex, InMemoryStoreIndex
from kvcore.testing.memory.managed import InMemoryBlockTransferTier, InMemoryManagedTier
from kvcore.testing.memory.mover import InMemoryBlockMover
from kvcore.testing.memory.peer import InMemoryAddressSpace, InMemoryPeerTransport
from kvcore.testing.memory.store import InMemoryChunkStore

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
]
