"""``LMCacheManagedTier``: kvcore's ``ManagedTier`` port on an LMCache multiprocess server.

Worker side. Values move between one host buffer (``StoreItem`` offsets index it) and the server's
shared-memory slots (engine-driven mode with ``--shm-name``). The tier is chained (see
``kvcore_lmcache.wire``): a job's items are cut into runs of consecutive chunks of the request's chain,
and each run is one server request. A store reserves a run's slots (``prepare_store``), copies header
and bytes in, and commits; a retrieve maps the slots of a run of locked hits (``prepare_retrieve``),
checks each header, copies out and commits, which releases the read locks. No tensor is ever pickled
onto the socket. Jobs run in submission order on one thread; the runs of a job are pipelined. The
server cannot remove or clear single keys: the tier does not offer either.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from lmcache.v1.multiprocess.futures import MessagingFuture

from kvcore.config import LMCacheMPConfig
from kvcore.errors import BackendError, InvalidSpecError, TransferTimeout, UsageError
from kvcore.ids import ChunkKey, JobId, LookupId, RequestId
from kvcore.jobs import JobBoard, JobResult
from kvcore.ports import StoreItem
from kvcore_lmcache.link import ServerLink, SlotLayout
from kvcore_lmcache.lookups import LookupBook
from kvcore_lmcache.wire import HEADER_BYTES, check_header, header

__all__ = ["LMCacheManagedTier"]

log = logging.getLogger(__name__)

_Job = Callable[[], JobResult]

_POLL_S = 0.0002
"""How often a job waiting for a lookup asks again."""


def _runs(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted, distinct positions as maximal ranges ``[start, end)`` of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for pos in sorted(set(positions)):
        if runs and runs[-1][1] == pos:
            runs[-1] = (runs[-1][0], pos + 1)
        else:
            runs.append((pos, pos + 1))
    return runs


def _chain_of(items: Sequence[StoreItem], chain: Sequence[ChunkKey]) -> tuple[ChunkKey, ...]:
    """The chain a call names; none: its items' keys, in order (the port's default)."""
    return tuple(chain) if chain else tuple(item.key for item in items)


def _positions(chain: Sequence[ChunkKey]) -> dict[ChunkKey, int]:
    positions: dict[ChunkKey, int] = {}
    for i, key in enumerate(chain):
        positions.setdefault(key, i)
    return positions


class _Hold:
    """The read locks one lookup's server session still holds for a kvcore session: the chunks of
    ``chain`` at ``positions``. The server session ends once none is left."""

    __slots__ = ("chain", "positions", "server")

    def __init__(self, server: str, chain: tuple[ChunkKey, ...], positions: set[int]) -> None:
        self.server = server
        self.chain = chain
        self.positions = positions


class LMCacheManagedTier:
    """A ``ManagedTier`` over an LMCache server, for values of at most ``value_bytes`` each.

    ``host`` is the worker's host buffer (a writable buffer: ``bytearray``, a NumPy array's memory, a
    pinned tensor's storage). Construction never fails because the server is absent (see
    ``ServerLink``); it raises ``ConfigError`` when the server's chunk size is not ``chunk_tokens``.
    """

    def __init__(
        self,
        config: LMCacheMPConfig,
        host: memoryview | bytearray,
        *,
        value_bytes: int,
        chunk_tokens: int,
        model_name: str,
    ) -> None:
        view = memoryview(host).cast("B")
        if view.readonly:
            raise InvalidSpecError("the host buffer must be writable")
        if value_bytes < 1:
            raise InvalidSpecError(f"value_bytes must be >= 1, got {value_bytes}")
        self._host = view
        self.value_bytes = value_bytes
        self.link = ServerLink(
            config,
            chunk_tokens,
            model_name,
            SlotLayout(value_bytes),
        )
        self._lookups = LookupBook(self.link)
        self._board = JobBoard()
        self._lock = threading.Lock()
        self._held: dict[RequestId, dict[ChunkKey, _Hold]] = {}  # locked hits, by session and key
        self._queue: queue.SimpleQueue[tuple[JobId, _Job] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name="kvcore-lmcache-jobs", daemon=True)
        self._worker.start()

    # -- lookups -----------------------------------------------------------------------------------

    def submit_lookup(
        self, session: RequestId, chunks: Sequence[ChunkKey], preceding: Sequence[ChunkKey] = ()
    ) -> LookupId:
        return self._lookups.submit(session, [(*preceding, *chunks)], len(preceding))

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        answer = self._lookups.poll(lookup_id)
        if answer is None:
            return None
        state, (hit,) = answer
        chain, first = state.chains[0], state.first
        # the chunks before ``first`` are held nearer by the caller: their locks go at once
        self._hold(state.session, state.servers[0], chain, range(first, max(hit, first)), ((0, first),))
        return max(hit - first, 0)

    def end_session(self, session: RequestId) -> None:
        self._lookups.cancel_session(session)
        with self._lock:
            holds = {id(h): h for h in self._held.pop(session, {}).values()}
        for hold in holds.values():
            self.link.release(hold.server, hold.chain, _runs(hold.positions))

    def _hold(
        self,
        session: RequestId,
        server: str,
        chain: tuple[ChunkKey, ...],
        kept: Iterable[int],
        released: Iterable[tuple[int, int]],
    ) -> None:
        """Keep the locks of ``kept`` positions for the session; release ``released`` ranges now (and
        end the server session if nothing is kept). A session keeps one lock per key: one that an
        earlier lookup of the session holds is released."""
        hold = _Hold(server, chain, set(kept))
        if not hold.positions:
            self.link.release(server, chain, released)
            return
        self.link.release(server, chain, released, end=False)
        replaced: list[tuple[_Hold, int]] = []
        with self._lock:
            held = self._held.setdefault(session, {})
            for pos in hold.positions:
                old = held.get(chain[pos])
                if old is not None:
                    old.positions.discard(pos)
                    replaced.append((old, pos))
                held[chain[pos]] = hold
        for old, pos in replaced:
            self.link.release(old.server, old.chain, ((pos, pos + 1),), end=not old.positions)

    # -- jobs --------------------------------------------------------------------------------------

    def poll(self) -> tuple[JobResult, ...]:
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._board.wait(job_ids, timeout)

    def submit_store(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        items, whole = self._checked(items), _chain_of(items, chain)
        return self._submit(lambda job_id: self._store(job_id, session, items, whole))

    def submit_retrieve(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        items, whole = self._checked(items), _chain_of(items, chain)
        return self._submit(lambda job_id: self._retrieve(job_id, session, items, whole))

    def close(self) -> None:
        """Finish queued jobs (each bounded by the request timeout), then drop the connection."""
        self._queue.put(None)
        self._worker.join()
        self.link.close()

    def _checked(self, items: Sequence[StoreItem]) -> tuple[StoreItem, ...]:
        size = len(self._host)
        for i, item in enumerate(items):
            if item.offset < 0 or item.length < 1 or item.offset + item.length > size:
                raise InvalidSpecError(
                    f"item {i} ({item.key}) spans [{item.offset}, {item.offset + item.length}), "
                    f"outside the host buffer of {size} bytes"
                )
            if item.length > self.value_bytes:
                raise InvalidSpecError(
                    f"item {i} ({item.key}) has {item.length} bytes; slots hold {self.value_bytes}"
                )
        return tuple(items)

    def _submit(self, work: Callable[[JobId], JobResult]) -> JobId:
        job_id = self._board.new()
        self._queue.put((job_id, lambda: work(job_id)))
        return job_id

    def _run(self) -> None:
        while (entry := self._queue.get()) is not None:
            job_id, work = entry
            try:
                result = work()
            except BackendError as exc:
                result = JobResult(job_id, error=str(exc))
            except Exception as exc:  # a bug must fail its job, not stop the thread every job waits on
                log.exception("kvcore: LMCache job %s failed", job_id)
                result = JobResult(job_id, error=repr(exc))
            self._board.finish(result)

    # -- store and retrieve (on the job thread) ----------------------------------------------------

    @staticmethod
    def _placed(
        items: tuple[StoreItem, ...], chain: tuple[ChunkKey, ...]
    ) -> tuple[dict[int, list[int]], list[int]]:
        """Item indices by chain position, and the items whose key is not in the chain."""
        where = _positions(chain)
        at: dict[int, list[int]] = {}
        missing: list[int] = []
        for i, item in enumerate(items):
            pos = where.get(item.key)
            if pos is None:
                missing.append(i)
            else:
                at.setdefault(pos, []).append(i)
        return at, missing

    def _store(
        self, job_id: JobId, session: RequestId, items: tuple[StoreItem, ...], chain: tuple[ChunkKey, ...]
    ) -> JobResult:
        if not self.link.available():
            return JobResult(job_id, tuple(range(len(items))), "LMCache server unavailable")
        at, failed = self._placed(items, chain)
        codec, client, iid = self.link.codec, self.link.client, self.link.instance_id
        server = self.link.server_session(session, f"s{job_id}")
        runs = _runs(at)
        keys = [codec.ipc_key(server, chain, start, end, 0) for start, end in runs]
        prepared = [client.prepare_store(key, iid) for key in keys]
        commits: list[tuple[list[int], MessagingFuture[bool]]] = []
        for (start, end), key, future in zip(runs, keys, prepared, strict=True):
            run_items = [i for pos in range(start, end) for i in at[pos]]
            reply = self._context(future, "prepare_store", lambda r: r.context)
            slots, indices = reply.get("slots"), reply.get("chunk_indices")
            if not isinstance(slots, list) or not isinstance(indices, list) or len(slots) != len(indices):
                failed.extend(run_items)
                continue
            if not slots:  # every chunk of the run is stored already: a store is idempotent
                continue
            written: list[int] = []
            for slot, index in zip(slots, indices, strict=True):
                targets = at.get(start + int(index), [])
                if targets and self._write(items[targets[0]], slot):
                    written.extend(targets)
                else:  # never commit a slot whose header could read as this key's value
                    self._poison(slot)
                    failed.extend(targets)
            commits.append((written, client.commit_store(key, iid, b"")))
        for written, commit in commits:
            if not self._reply(commit, "commit_store"):
                failed.extend(written)
        self.link.release(server, chain, ())
        return JobResult(job_id, tuple(sorted(set(failed))))

    def _retrieve(
        self, job_id: JobId, session: RequestId, items: tuple[StoreItem, ...], chain: tuple[ChunkKey, ...]
    ) -> JobResult:
        if not self.link.available():
            return JobResult(job_id, tuple(range(len(items))), "LMCache server unavailable")
        at, failed = self._placed(items, chain)
        if not at:
            return JobResult(job_id, tuple(failed))
        codec, client, iid = self.link.codec, self.link.client, self.link.instance_id
        server = self.link.server_session(session, f"r{job_id}")
        with self._lock:
            held = self._held.get(session, {})
            holds = {pos: held[chain[pos]] for pos in at if chain[pos] in held}
        # what no earlier lookup of the session locked is locked now, by a lookup of this job
        locked_here, lookup = (
            (0, None) if len(holds) == len(at) else self._lock_now(session, chain[: max(at) + 1])
        )
        wanted = [pos for pos in at if pos in holds or pos < locked_here]
        failed.extend(i for pos in at if pos not in wanted for i in at[pos])
        runs = _runs(wanted)
        keys = [codec.ipc_key(server, chain, start, end, 0) for start, end in runs]
        prepared = [client.prepare_retrieve(key, iid) for key in keys]
        # Every prepare gets its commit (a no-op when nothing is pending): a reply that came too late
        # still leaves the server's read pending, and the commit, on the same server thread, ends it.
        commits = [client.commit_retrieve(key, iid) for key in keys]
        leftover = set(range(locked_here))
        for (start, end), future in zip(runs, prepared, strict=True):
            slots, consumed = self._prepared_slots(future)
            if consumed:  # a prepare consumed one lock per chunk of its run, whatever it found
                for pos in range(start, end):
                    hold = holds.get(pos)
                    if hold is None:
                        leftover.discard(pos)
                    else:
                        self._unhold(session, hold, pos)
            if slots is None or len(slots) != end - start:
                failed.extend(i for pos in range(start, end) for i in at[pos])
                continue
            for pos, slot in zip(range(start, end), slots, strict=True):
                failed.extend(i for i in at[pos] if not self._read(items[i], slot))
        for commit in commits:
            self._reply(commit, "commit_retrieve")
        if lookup is not None:
            self.link.release(lookup, chain, _runs(leftover))
        self.link.release(server, chain, ())
        return JobResult(job_id, tuple(sorted(set(failed))))

    def _prepared_slots(self, future: MessagingFuture[Any]) -> tuple[list[Any] | None, bool]:
        """A retrieve's slots (``None``: nothing to read) and whether it consumed its run's locks: all
        but an error reply do (a miss releases what it found; silence may still be handled later)."""
        try:
            reply = self.link.result(future, "prepare_retrieve")
        except TransferTimeout as exc:
            log.warning("kvcore: %s", exc)
            return None, True
        except BackendError as exc:
            log.warning("kvcore: %s", exc)
            return None, False
        slots = reply.context.get("slots") if reply.success and isinstance(reply.context, dict) else None
        return (slots if isinstance(slots, list) else None), True

    def _unhold(self, session: RequestId, hold: _Hold, pos: int) -> None:
        """A hold's lock at ``pos`` was consumed; end its server session once none is left."""
        with self._lock:
            hold.positions.discard(pos)
            held = self._held.get(session)
            if held is not None and held.get(hold.chain[pos]) is hold:
                del held[hold.chain[pos]]
            done = not hold.positions
        if done:
            self.link.release(hold.server, hold.chain, ())

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
            reply = context(self.link.result(future, what))
        except BackendError as exc:
            log.warning("kvcore: %s", exc)
            return {}
        return reply if isinstance(reply, dict) else {}

    def _reply(self, future: MessagingFuture[bool], what: str) -> bool:
        try:
            return bool(self.link.result(future, what))
        except BackendError as exc:
            log.warning("kvcore: %s", exc)
            return False

    def _slot_span(self, slot: Any) -> tuple[int, int] | None:
        try:
            offset, length = int(slot["offset"]), int(slot["length"])
        except (KeyError, TypeError, ValueError):
            return None
        if length != self.link.layout.slot_bytes:
            return None
        return offset, length

    def _write(self, item: StoreItem, slot: Any) -> bool:
        span = self._slot_span(slot)
        with self.link.segment_lock:
            segment = self.link.segment
            if span is None or segment is None or span[0] + span[1] > segment.size:
                return False
            base = span[0]
            value = self._host[item.offset : item.offset + item.length]
            segment.view[base + HEADER_BYTES : base + HEADER_BYTES + item.length] = value
            # the header last: a slot whose copy did not finish never reads as this key's value
            segment.view[base : base + HEADER_BYTES] = header(item.key, item.length)
        return True

    def _poison(self, slot: Any) -> None:
        span = self._slot_span(slot)
        with self.link.segment_lock:
            segment = self.link.segment
            if span is not None and segment is not None and span[0] + HEADER_BYTES <= segment.size:
                segment.view[span[0] : span[0] + HEADER_BYTES] = bytes(HEADER_BYTES)

    def _read(self, item: StoreItem, slot: Any) -> bool:
        span = self._slot_span(slot)
        with self.link.segment_lock:
            segment = self.link.segment
            if span is None or segment is None or span[0] + span[1] > segment.size:
                return False
            base = span[0]
            if not check_header(item.key, item.length, bytes(segment.view[base : base + HEADER_BYTES])):
                return False
            source = segment.view[base + HEADER_BYTES : base + HEADER_BYTES + item.length]
            self._host[item.offset : item.offset + item.length] = source
        return True
