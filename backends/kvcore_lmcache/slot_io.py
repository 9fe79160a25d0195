"""Store and retrieve jobs against an LMCache server's shared-memory slots, each part of a job on the
thread that runs it (the tier's job thread, or a part's own).

A job's items are cut into runs of consecutive chunks of the request's chain, and each run is one server
request; the runs of a job are pipelined. A store reserves a run's slots (``prepare_store``), copies the
values in, writes each slot's header and commits; a retrieve maps the slots of a run of locked hits
(``prepare_retrieve``), checks each header, copies the values out and commits, which releases the read
locks (those a lookup of the session took or the session adopted, else a lookup of the job's own). A
retrieve is done once its copies are: its result is handed over before the commits are answered (they
only end the server's reads), a round trip sooner. No tensor is ever pickled onto the socket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache.v1.multiprocess.futures import MessagingFuture

from kvcore.errors import BackendError, TransferTimeout, UsageError
from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.jobs import JobResult
from kvcore_lmcache.link import Segment, ServerLink
from kvcore_lmcache.lookups import LookupBook
from kvcore_lmcache.sessions import Hold, SessionLocks, runs
from kvcore_lmcache.values import Values
from kvcore_lmcache.wire import HEADER_BYTES, check_header, header

__all__ = ["SlotIO"]

log = logging.getLogger(__name__)

_POLL_S = 0.0002
"""How often a job waiting for a lookup asks again."""


def _positions(chain: Sequence[ChunkKey]) -> dict[ChunkKey, int]:
    positions: dict[ChunkKey, int] = {}
    for i, key in enumerate(chain):
        positions.setdefault(key, i)
    return positions


class SlotIO:
    """Runs store and retrieve jobs of one link's tier, each part on the calling thread."""

    def __init__(self, link: ServerLink, lookups: LookupBook, locks: SessionLocks) -> None:
        self._link = link
        self._lookups = lookups
        self._locks = locks

    @staticmethod
    def _placed(
        keys: Sequence[ChunkKey], chain: tuple[ChunkKey, ...]
    ) -> tuple[dict[int, list[int]], list[int]]:
        """Item indices by chain position, and the items whose key is not in the chain."""
        where = _positions(chain)
        at: dict[int, list[int]] = {}
        missing: list[int] = []
        for i, key in enumerate(keys):
            pos = where.get(key)
            if pos is None:
                missing.append(i)
            else:
                at.setdefault(pos, []).append(i)
        return at, missing

    def _pool(self, values: Values) -> Segment | None:
        """The server's pool a job works in, if the server is up and the values can reach it; ``None``
        fails the job before the server is asked for anything."""
        with self._link.segment_lock:
            pool = self._link.segment
        if not self._link.available() or pool is None or pool.closed or not values.ready(pool):
            return None
        return pool

    def _refused(self, job_id: JobId, values: Values) -> JobResult:
        """Every item of a job ``_pool`` refused failed, and why."""
        why = str(self._link.unavailable()) if not self._link.available() else "the LMCache pool is unusable"
        return JobResult(job_id, tuple(range(len(values.keys))), why)

    def store(
        self, job_id: JobId, session: RequestId, values: Values, chain: tuple[ChunkKey, ...], part: int = 0
    ) -> JobResult:
        """Store a job's values (part ``part`` of it: each part of a job is a server session of its own,
        since the server keeps a session's chain)."""
        pool = self._pool(values)
        if pool is None:
            return self._refused(job_id, values)
        at, failed = self._placed(values.keys, chain)
        codec, client, iid = self._link.codec, self._link.client, self._link.instance_id
        server = self._link.server_session(session, f"s{job_id}.{part}")
        spans = runs(at)
        keys = [codec.ipc_key(server, chain, start, end, 0) for start, end in spans]
        prepared = [client.prepare_store(key, iid) for key in keys]
        commits: list[tuple[list[int], MessagingFuture[bool]]] = []
        for (start, end), key, future in zip(spans, keys, prepared, strict=True):
            run_items = [i for pos in range(start, end) for i in at[pos]]
            reply = self._context(future, "prepare_store", lambda r: r.context)
            slots, indices = reply.get("slots"), reply.get("chunk_indices")
            if not isinstance(slots, list) or not isinstance(indices, list) or len(slots) != len(indices):
                failed.extend(run_items)
                continue
            if not slots:  # every chunk of the run is stored already: a store is idempotent
                continue
            filled: list[tuple[list[int], int]] = []  # the items of a slot, and the slot
            for slot, index in zip(slots, indices, strict=True):
                targets, offset = at.get(start + int(index), []), self._slot_offset(slot, pool)
                if targets and offset is not None:
                    filled.append((targets, offset))
                else:
                    failed.extend(targets)
                    if offset is not None:  # never commit a slot whose header could read as a value
                        self._seal(offset, None, pool)
            bad = values.put([(targets[0], offset) for targets, offset in filled], pool)
            written: list[int] = []
            for targets, offset in filled:
                i = targets[0]
                # the header last: a slot whose copy did not finish never reads as this key's value
                raw = None if i in bad else header(values.keys[i], values.lengths[i])
                ok = self._seal(offset, raw, pool) and raw is not None
                (written if ok else failed).extend(targets)
            commits.append((written, client.commit_store(key, iid, b"")))
        for written, commit in commits:
            if not self._reply(commit, "commit_store"):
                failed.extend(written)
        self._link.release(server, chain, ())
        return JobResult(job_id, tuple(sorted(set(failed))))

    def retrieve(
        self,
        job_id: JobId,
        session: RequestId,
        values: Values,
        chain: tuple[ChunkKey, ...],
        done: Callable[[JobResult], object],
        part: int = 0,
    ) -> None:
        """Run a retrieve (part ``part`` of a job, as ``store``); ``done`` gets its result once, as soon
        as the copies are in (or the job found nothing to read), before this waits for the commits'
        replies and releases the locks. A job that raises before that never calls ``done``: its caller
        fails it."""
        at, failed = self._placed(values.keys, chain)
        # the session's locks on what this job reads are the job's alone from now on: it releases what
        # it did not read (or could not) once its commits are answered, whatever becomes of it
        holds = self._locks.take(session, chain, at)
        try:
            self._retrieve(job_id, session, values, chain, at, failed, holds, done, part)
        finally:
            for hold in {id(hold): hold for hold in holds.values()}.values():
                hold.release(self._link)

    def _retrieve(
        self,
        job_id: JobId,
        session: RequestId,
        values: Values,
        chain: tuple[ChunkKey, ...],
        at: dict[int, list[int]],
        failed: list[int],
        holds: dict[int, Hold],
        done: Callable[[JobResult], object],
        part: int,
    ) -> None:
        pool = self._pool(values)
        if pool is None:
            done(self._refused(job_id, values))
            return
        if not at:
            done(JobResult(job_id, tuple(failed)))
            return
        codec, client, iid = self._link.codec, self._link.client, self._link.instance_id
        # what no earlier lookup of the session locked is locked now, by a lookup of this job
        locked_here, lookup = (
            (0, None) if len(holds) == len(at) else self._lock_now(session, chain[: max(at) + 1])
        )
        leftover = set(range(locked_here))
        wanted = [pos for pos in at if pos in holds or pos < locked_here]
        failed.extend(i for pos in at if pos not in wanted for i in at[pos])
        # Reading under one lookup's locks only (the usual hand-over), the transfers name that lookup's
        # server session, which then ends once, with the hold's release; otherwise a session of its own.
        sessions = {holds[pos].server if pos in holds else None for pos in wanted}
        shared = sessions.pop() if len(sessions) == 1 else None
        server = shared if shared is not None else self._link.server_session(session, f"r{job_id}.{part}")
        spans = runs(wanted)
        keys = [codec.ipc_key(server, chain, start, end, 0) for start, end in spans]
        prepared = [client.prepare_retrieve(key, iid) for key in keys]
        commits: list[MessagingFuture[bool]] = []
        settled = 0  # leading spans whose locks are accounted for
        try:
            try:
                for (start, end), key, future in zip(spans, keys, prepared, strict=True):
                    try:
                        slots, consumed = self._prepared_slots(future)
                        if consumed:  # a prepare consumed one lock per chunk of its run, whatever it found
                            self._consumed(range(start, end), holds, leftover)
                        settled += 1
                        failed.extend(self._read_run(values, pool, at, (start, end), slots))
                    finally:
                        # Every prepare gets its commit, after the run's copies: the commit ends the
                        # server's read, and the slot may be reused from then on. A reply that came too
                        # late still leaves the read pending, and the commit, on the same server thread,
                        # ends it.
                        commits.append(client.commit_retrieve(key, iid))
            finally:
                for start, end in spans[settled:]:  # prepared, never read (something raised): consumed
                    self._consumed(range(start, end), holds, leftover)
                commits.extend(client.commit_retrieve(key, iid) for key in keys[len(commits) :])
            done(JobResult(job_id, tuple(sorted(set(failed)))))
        finally:
            for commit in commits:
                self._reply(commit, "commit_retrieve")
            if lookup is not None:
                self._link.release(lookup, chain, runs(leftover))
            if shared is None:
                self._link.release(server, chain, ())

    @staticmethod
    def _consumed(positions: range, holds: dict[int, Hold], leftover: set[int]) -> None:
        """The locks at ``positions`` are gone: they leave their holds, or this job's own lookup's."""
        for pos in positions:
            hold = holds.get(pos)
            if hold is None:
                leftover.discard(pos)
            else:
                hold.positions.discard(pos)

    def _read_run(
        self,
        values: Values,
        pool: Segment,
        at: dict[int, list[int]],
        run: tuple[int, int],
        slots: list[Any] | None,
    ) -> list[int]:
        """Copy out the chain positions ``run`` (``[start, end)``) from the ``slots`` their prepare
        mapped (``None``: nothing to read); returns the items that failed."""
        start, end = run
        if slots is None or len(slots) != end - start:
            return [i for pos in range(start, end) for i in at[pos]]
        failed: list[int] = []
        found: list[tuple[int, int]] = []  # (item, slot) of every item whose slot holds its key
        for pos, slot in zip(range(start, end), slots, strict=True):
            offset = self._slot_offset(slot, pool)
            for i in at[pos]:
                if offset is not None and self._holds(offset, values.keys[i], values.lengths[i], pool):
                    found.append((i, offset))
                else:
                    failed.append(i)
        failed.extend(values.get(found, pool))
        return failed

    def _prepared_slots(self, future: MessagingFuture[Any]) -> tuple[list[Any] | None, bool]:
        """A retrieve's slots (``None``: nothing to read) and whether it consumed its run's locks: all
        but an error reply do (a miss releases what it found; silence may still be handled later)."""
        try:
            reply = self._link.result(future, "prepare_retrieve")
        except TransferTimeout as exc:
            log.warning("kvcore: %s", exc)
            return None, True
        except BackendError as exc:
            log.warning("kvcore: %s", exc)
            return None, False
        slots = reply.context.get("slots") if reply.success and isinstance(reply.context, dict) else None
        return (slots if isinstance(slots, list) else None), True

    def _lock_now(self, session: RequestId, chain: tuple[ChunkKey, ...]) -> tuple[int, str | None]:
        """Look ``chain`` up and wait for the answer: the leading chunks hit, now read-locked in the
        returned server session (0 and ``None`` on any failure, nothing left locked). It polls: a
        server-side wait would hold one of the server's request threads, which other clients share."""
        try:
            lookup_id = self._lookups.submit(session, [chain])
            while (answer := self._lookups.poll(lookup_id)) is None:
                time.sleep(_POLL_S)
        except (BackendError, UsageError) as exc:  # UsageError: the session ended meanwhile
            log.warning("kvcore: LMCache lookup before retrieve failed: %s", exc)
            return 0, None
        state, (hit,) = answer
        return hit, state.servers[0]

    def _context(
        self, future: MessagingFuture[Any], what: str, context: Callable[[Any], Any]
    ) -> dict[str, Any]:
        try:
            reply = context(self._link.result(future, what))
        except BackendError as exc:
            log.warning("kvcore: %s", exc)
            return {}
        return reply if isinstance(reply, dict) else {}

    def _reply(self, future: MessagingFuture[bool], what: str) -> bool:
        try:
            return bool(self._link.result(future, what))
        except BackendError as exc:
            log.warning("kvcore: %s", exc)
            return False

    def _slot_offset(self, slot: Any, pool: Segment) -> int | None:
        """A slot's offset in ``pool``, if the slot is one of this layout's and lies inside the pool."""
        try:
            offset, length = int(slot["offset"]), int(slot["length"])
        except (KeyError, TypeError, ValueError):
            return None
        inside = offset >= 0 and offset + length <= pool.size
        return offset if inside and length == self._link.layout.slot_bytes else None

    def _seal(self, offset: int, raw: bytes | None, pool: Segment) -> bool:
        """Write the header of the slot at ``offset``; ``None`` writes a zeroed one, which never reads as
        a value. False: the pool was unmapped meanwhile (nothing written)."""
        with self._link.segment_lock:
            if pool.closed:
                return False
            pool.view[offset : offset + HEADER_BYTES] = raw if raw is not None else bytes(HEADER_BYTES)
        return True

    def _holds(self, offset: int, key: ChunkKey, length: int, pool: Segment) -> bool:
        """Whether the slot at ``offset`` holds a ``length``-byte value stored under ``key``."""
        with self._link.segment_lock:
            if pool.closed:
                return False
            return check_header(key, length, bytes(pool.view[offset : offset + HEADER_BYTES]))
