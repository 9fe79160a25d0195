"""The worker's view of a remote tier (``kvcore.ports.RemoteTier``) over each kind of tier.

Both kinds of remote tier fit it: a ``ChunkStore`` (Mooncake store: content-addressed, no sessions) and a
``ManagedTier`` (LMCache server: sessions that hold read locks). ``BlockWorker`` chains these jobs with
its ``BlockMover`` copies, so a load is fetch-then-copy and a save copy-then-publish.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence

from kvcore.errors import BackendError, UsageError
from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.jobs import JobResult
from kvcore.kit.closing import close_quietly
from kvcore.ports import (
    BlockItem,
    ChunkStore,
    ManagedTier,
    StoreItem,
    SupportsAdoptedLocks,
    SupportsBlockTransfer,
)

__all__ = ["ManagedRemote", "StoreRemote"]

log = logging.getLogger(__name__)


class _Remote:
    """What both remote tiers share: the tier beneath's job queue, and ``close``, after which the remote
    tier refuses every submit with ``UsageError`` (whatever the tier beneath would raise)."""

    def __init__(self, tier: ChunkStore | ManagedTier) -> None:
        self._tier = tier
        self._lock = threading.Lock()
        self._closed = False

    def poll(self) -> tuple[JobResult, ...]:
        return self._tier.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._tier.wait(job_ids, timeout)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        close_quietly(self._tier)

    def _check_open(self, call: str) -> None:
        with self._lock:
            if self._closed:
                raise UsageError(f"{call}: the remote tier ({type(self).__name__}) is closed")


class StoreRemote(_Remote):
    """A ``ChunkStore`` as a remote tier (sessions mean nothing to it)."""

    def __init__(self, store: ChunkStore) -> None:
        super().__init__(store)
        self.store = store

    def submit_fetch(self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()) -> JobId:
        self._check_open("submit_fetch")
        return self.store.submit_get(items)

    def submit_publish(
        self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        self._check_open("submit_publish")
        return self.store.submit_put(items)

    def adopt(self, session: str, holder: str, chain: Sequence[ChunkKey], start: int, end: int) -> None:
        """A store takes no locks."""

    def end_session(self, session: str) -> None:
        """A store keeps no sessions."""


class ManagedRemote(_Remote):
    """A ``ManagedTier`` as a remote tier: a request is a session."""

    def __init__(self, tier: ManagedTier) -> None:
        super().__init__(tier)
        self.tier = tier

    def submit_fetch(self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()) -> JobId:
        self._check_open("submit_fetch")
        return self.tier.submit_retrieve(RequestId(session), items, chain)

    def submit_publish(
        self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        self._check_open("submit_publish")
        return self.tier.submit_store(RequestId(session), items, chain)

    def submit_fetch_blocks(
        self, session: str, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        self._check_open("submit_fetch_blocks")
        return self._blocks().submit_retrieve_blocks(RequestId(session), items, chain)

    def submit_publish_blocks(
        self, session: str, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        self._check_open("submit_publish_blocks")
        return self._blocks().submit_store_blocks(RequestId(session), items, chain)

    def abandon(self, job_id: JobId) -> bool:
        return isinstance(self.tier, SupportsBlockTransfer) and self.tier.abandon(job_id)

    def _blocks(self) -> SupportsBlockTransfer:
        if not isinstance(self.tier, SupportsBlockTransfer):
            raise BackendError(f"{type(self.tier).__name__} cannot move engine blocks itself")
        return self.tier

    def adopt(self, session: str, holder: str, chain: Sequence[ChunkKey], start: int, end: int) -> None:
        if isinstance(self.tier, SupportsAdoptedLocks):
            self.tier.adopt(RequestId(session), holder, chain, start, end)
        else:  # only a scheduler whose index holds locks hands them over: the same backend's tier
            log.warning("kvcore: %s cannot take over locks; they lapse on the tier", type(self.tier).__name__)

    def end_session(self, session: str) -> None:
        self.tier.end_session(RequestId(session))
