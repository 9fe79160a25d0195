"""The worker's view of a remote tier (``kvcore.ports.RemoteTier``) over each kind of tier.

Both kinds of remote tier fit it: a ``ChunkStore`` (Mooncake store: content-addressed, no sessions) and a
``ManagedTier`` (LMCache server: sessions that hold read locks). ``BlockWorker`` chains these jobs with
its ``BlockMover`` copies, so a load is fetch-then-copy and a save copy-then-publish.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence

import attrs

from kvcore.errors import BackendError, UsageError
from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.jobs import JobResult
from kvcore.kit.closing import close_quietly
from kvcore.model.head_runs import HeadRuns
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
    """A ``ChunkStore`` as a remote tier (sessions mean nothing to it).

    Given the rank's ``HeadRuns`` (a backend that keeps values per KV head, ``BackendSettings.PER_HEAD``),
    each of the rank's values becomes one per head it holds (``kvcore.keying.keys.head_keys``, gathered
    from and scattered into the slot's runs), so engines at every tensor-parallel size share them; a
    chunk's fetch or publish fails where one of its heads' did (a fetch's slot is then freed, never read).
    It owns its store: a split job's result is told in chunks only through its own ``poll``/``wait``.
    """

    def __init__(self, store: ChunkStore, heads: HeadRuns | None = None) -> None:
        super().__init__(store)
        self.store = store
        self._heads = heads if heads is not None and heads.heads > 1 else None
        self._owners: dict[JobId, tuple[int, ...]] = {}  # a split job's parts: the item each belongs to

    def submit_fetch(self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()) -> JobId:
        self._check_open("submit_fetch")
        return self._split(self.store.submit_get, items)

    def submit_publish(
        self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        self._check_open("submit_publish")
        return self._split(self.store.submit_put, items)

    def poll(self) -> tuple[JobResult, ...]:
        return tuple(self._joined(result) for result in self.store.poll())

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return tuple(self._joined(result) for result in self.store.wait(job_ids, timeout))

    def close(self) -> None:
        super().close()
        with self._lock:
            self._owners.clear()  # results still to come are the tier's: nobody reads them as this one's

    def adopt(self, session: str, holder: str, chain: Sequence[ChunkKey], start: int, end: int) -> None:
        """A store takes no locks."""

    def end_session(self, session: str) -> None:
        """A store keeps no sessions."""

    def _split(self, submit: Callable[[Sequence[StoreItem]], JobId], items: Sequence[StoreItem]) -> JobId:
        heads = self._heads
        if heads is None:
            return submit(items)
        parts: list[StoreItem] = []
        owners: list[int] = []
        for i, item in enumerate(items):
            parts.extend(heads.split(f"items[{i}]", item))
            owners.extend([i] * heads.heads)
        with self._lock:
            job_id = submit(parts)
            self._owners[job_id] = tuple(owners)
        return job_id

    def _joined(self, result: JobResult) -> JobResult:
        """A split job's result over its items: an item failed where any of its heads did."""
        with self._lock:
            owners = self._owners.pop(result.job_id, None)
        if owners is None or not result.failed:
            return result
        failed = tuple(sorted({owners[part] for part in result.failed}))
        return attrs.evolve(result, failed=failed)


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
