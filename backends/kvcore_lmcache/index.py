"""``LMCacheChunkIndex``: the scheduler's view of an LMCache server, as kvcore's ``ChunkIndex`` port.

It runs in the scheduler process (vLLM's engine core), apart from the workers, and asks which leading
chunks the server holds. A plain lookup's read locks are released as soon as it is answered. A *held*
lookup (``SupportsHeldLookups``) keeps the locks of the chunks it answered, one lookup per rank (per KV
head of each rank, below), and the
scheduler hands them to the workers with the load (each rank's ``LMCacheManagedTier`` prepares those
chunks under them with no lookup of its own, and releases what it does not read) or releases them.
The locks a held lookup does not keep (chunks before the asked ones, a rank's hits past the answer)
are released, and answered, before the lookup answers, so that no release of this index's reaches the
server after a worker ended the server session (a release left unanswered at the request timeout is
the exception: its lock lapses). A hand-over is refused once ``lock_handover_s`` have passed since the
answer (the server's read locks lapse: ``--l1-read-ttl-seconds``, 300 by default); the workers then
lock what they read themselves, and a lock that lapsed all the same is a miss at the retrieve. Locks
too old to trust are never released, only left to lapse (``ServerLink.release``).

Where the server keeps a value per KV head, a shard's key is its heads' keys joined
(``kvcore.keying.keys.head_keys``): each head is looked up in a chain of its own (``kvcore_lmcache.heads``),
a chunk counts where every head's does, and a held lookup names each rank's heads' server sessions joined
as the rank's holder.

A lookup never blocks: submit, then poll; an absent server raises ``BackendUnavailable`` at once and a silent
one ``TransferTimeout`` at the request timeout, which ``kvcore.scheduling.remote_lookup.PrefixLookup`` turns
into a miss and its circuit breaker.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from lmcache.v1.multiprocess.futures import MessagingFuture

from kvcore.errors import BackendError, BackendUnavailable, UsageError
from kvcore.ids import ChunkKey, LookupId, RequestId
from kvcore.keying.keys import head_keys
from kvcore.ports import HeldChunks
from kvcore_lmcache.config import LMCacheMPConfig
from kvcore_lmcache.heads import HOLDER_SEPARATOR
from kvcore_lmcache.link import ServerLink, SlotLayout
from kvcore_lmcache.lookups import LookupBook, LookupState

__all__ = ["LMCacheChunkIndex"]

log = logging.getLogger(__name__)


class _Held:
    """A held lookup's kept locks: answered, then (once the locks it does not keep are released)
    taken by the scheduler, then handed over or released."""

    __slots__ = ("at", "chains", "held", "releases", "servers")

    def __init__(
        self, state: LookupState, answer: int, releases: list[MessagingFuture[Any]], groups: tuple[int, ...]
    ) -> None:
        servers = iter(state.servers)
        holders = tuple(HOLDER_SEPARATOR.join(itertools.islice(servers, count)) for count in groups)
        self.held = HeldChunks(holders, state.first, state.first + answer)
        self.servers = state.servers
        self.chains = state.chains
        self.releases = releases
        self.at = time.monotonic()  # the locks are as old as this, or a little older


class LMCacheChunkIndex:
    """Which leading chunks (every shard's key present) an LMCache server holds.

    ``value_bytes`` and ``block_bytes`` must be the workers' (their slot size is part of the server-side
    model name their layout is registered under); the index itself registers nothing.
    """

    def __init__(
        self,
        config: LMCacheMPConfig,
        *,
        value_bytes: int,
        chunk_tokens: int,
        model_name: str,
        block_bytes: int = 1,
    ) -> None:
        self.link = ServerLink(
            config,
            chunk_tokens,
            model_name,
            SlotLayout(value_bytes, block_bytes),
            register=False,
        )
        self._lookups = LookupBook(self.link)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        # chunks asked (after the preceding ones), and the chains of each shard (its KV heads)
        self._asked: dict[LookupId, tuple[int, tuple[int, ...]]] = {}
        self._holding: set[LookupId] = set()  # held lookups not answered yet
        self._settling: dict[LookupId, _Held] = {}  # answered; releasing the locks they do not keep
        self._answered: dict[LookupId, _Held] = {}  # answered, for ``take_held``
        self._taken: dict[HeldChunks, _Held] = {}  # taken, until handed over or released
        self._closed = False

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        """One server lookup per shard: the shard's keys of ``preceding`` and ``chunks`` as one chain.
        Raises ``BackendUnavailable`` while the server is down, and after ``close``."""
        return self._submit(chunks, preceding)

    def submit_held_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        """One server lookup per rank (each rank's prepare consumes one lock), or per KV head of each
        rank; the answered chunks stay locked for ``take_held``. With ``lock_handover_s`` 0, a plain
        lookup (one per shard)."""
        if self.link.config.lock_handover_s <= 0:
            return self._submit(
                [tuple(dict.fromkeys(chunk)) for chunk in chunks],
                [tuple(dict.fromkeys(chunk)) for chunk in preceding],
            )
        lookup_id = self._submit(chunks, preceding)
        with self._lock:
            self._holding.add(lookup_id)
        return lookup_id

    def _submit(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]]
    ) -> LookupId:
        self._check_open()
        whole = [[head_keys(key) for key in chunk] for chunk in (*preceding, *chunks)]
        shapes = {tuple(len(keys) for keys in chunk) for chunk in whole}
        if len(shapes) > 1 or () in shapes:
            raise UsageError(
                f"every chunk needs the same, non-zero number of shard keys, each of as many KV heads; got "
                f"{sorted(shapes)} (KV heads per shard)"
            )
        groups = shapes.pop() if shapes else (1,)
        chains = [
            [chunk[shard][head] for chunk in whole]
            for shard, count in enumerate(groups)
            for head in range(count)
        ]
        session = RequestId(f"index-{next(self._ids)}")
        lookup_id = self._lookups.submit(session, chains, len(preceding))
        with self._lock:
            self._asked[lookup_id] = (len(chunks), groups)
        return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        self._check_open()
        with self._lock:
            shape = self._asked.get(lookup_id)
            settling = self._settling.get(lookup_id)
        if shape is None:
            raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
        asked, groups = shape
        if settling is not None:
            return self._settle(lookup_id, settling)
        try:
            answer = self._lookups.poll(lookup_id)
        except BaseException:
            with self._lock:
                self._asked.pop(lookup_id, None)
                self._holding.discard(lookup_id)
            raise
        if answer is None:
            return None
        state, hits = answer
        answered = min(max(min(hits) - state.first, 0), asked)
        with self._lock:
            holding = lookup_id in self._holding
            self._holding.discard(lookup_id)
        if not (holding and answered):
            with self._lock:
                self._asked.pop(lookup_id, None)
            self._release_all(state.servers, state.chains)
            return answered
        end = state.first + answered
        client, codec = self.link.client, self.link.codec
        releases = [
            client.free_lookup_locks(codec.ipc_key(server, chain, start, stop, None), 1)
            for server, chain, hit in zip(state.servers, state.chains, hits, strict=True)
            for start, stop in ((0, state.first), (end, hit))
            if start < stop
        ]
        record = _Held(state, answered, releases, groups)
        with self._lock:
            self._settling[lookup_id] = record
        return self._settle(lookup_id, record)

    def _settle(self, lookup_id: LookupId, record: _Held) -> int | None:
        """A held lookup's answer once the locks it does not keep are released (``None`` until then).
        A release that failed or was not answered by the lookup's deadline leaves a lock to lapse."""
        pending = [future for future in record.releases if not future.query()]
        if pending and time.monotonic() - record.at < self.link.config.request_timeout_s:
            time.sleep(0)  # as ``LookupBook.poll``: let the client's reply thread hand over what arrived
            return None
        for future in record.releases:
            try:
                self.link.result(future, "free_lookup_locks", timeout=0)
            except BackendError as exc:
                log.warning("kvcore: %s (the lock lapses on the server)", exc)
        with self._lock:
            self._asked.pop(lookup_id, None)
            self._settling.pop(lookup_id, None)
            self._answered[lookup_id] = record
        return record.held.end - record.held.start

    def lookup_progress(self, lookup_id: LookupId) -> float | None:
        """When the server last answered a round of the lookup (``SupportsLookupProgress``): a held
        lookup releasing the locks it does not keep made progress when it was answered."""
        with self._lock:
            settling = self._settling.get(lookup_id)
        return settling.at if settling is not None else self._lookups.progress(lookup_id)

    def take_held(self, lookup_id: LookupId) -> HeldChunks | None:
        with self._lock:
            record = self._answered.pop(lookup_id, None)
            if record is not None:
                self._taken[record.held] = record
        return None if record is None else record.held

    def hand_over(self, held: HeldChunks) -> bool:
        with self._lock:
            record = self._taken.pop(held, None)
            fresh = not self._closed and record is not None
        if record is None:
            return False
        if fresh and time.monotonic() - record.at <= self.link.config.lock_handover_s:
            return True
        self._release_kept(record)
        return False

    def release_held(self, held: HeldChunks) -> None:
        with self._lock:
            record = self._taken.pop(held, None)
        if record is not None:
            self._release_kept(record)

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        with self._lock:
            self._asked.pop(lookup_id, None)
            self._holding.discard(lookup_id)
            record = self._settling.pop(lookup_id, None) or self._answered.pop(lookup_id, None)
        if record is not None:
            self._release_kept(record)
        self._lookups.cancel(lookup_id)

    def close(self) -> None:
        """Drop the pending lookups, the locks held for hand-overs (they lapse on the server) and the
        connection; later lookups raise ``BackendUnavailable``. Idempotent."""
        with self._lock:
            self._closed = True
            self._asked.clear()
            self._holding.clear()
            self._settling.clear()
            self._answered.clear()
            self._taken.clear()
        self.link.close()

    def _release_all(self, servers: Sequence[str], chains: Sequence[Sequence[ChunkKey]]) -> None:
        """Release every lock of these lookups' server sessions and end them."""
        for server, chain in zip(servers, chains, strict=True):
            self.link.release(server, chain, ((0, len(chain)),))

    def _release_kept(self, record: _Held) -> None:
        """Release the locks a held lookup kept and end its server sessions. Only those: the others were
        released before it answered (or are being: this waits for them), and the server's counts are
        anonymous (releasing a chunk twice would take another reader's lock)."""
        held = record.held
        for server, chain in zip(record.servers, record.chains, strict=True):
            ranges = ((held.start, held.end),)
            self.link.release(server, chain, ranges, taken_at=record.at, after=record.releases)

    def _check_open(self) -> None:
        with self._lock:
            if self._closed:
                raise BackendUnavailable("the LMCache index is closed")
