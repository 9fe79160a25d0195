"""``LMCacheManagedTier``: kvcore's ``ManagedTier`` port on an LMCache multiprocess server.

Worker side. Values move between the server's shared-memory slots (engine-driven mode with
``--shm-name``) and either the engine's KV blocks, copied by a block mover over the server's pool
(``SupportsBlockTransfer``: nothing of the engine's stands between), or one host buffer of the worker's
(``StoreItem`` offsets index it: the ``ManagedTier`` calls). The tier is chained (see
``kvcore_lmcache.wire``): a job's items are cut into runs of consecutive chunks of the request's chain,
and each run is one server request. A store reserves a run's slots (``prepare_store``), copies the
values in, writes each slot's header and commits; a retrieve maps the slots of a run of locked hits
(``prepare_retrieve``), checks each header, copies the values out and commits, which releases the read
locks. No tensor is ever pickled onto the socket. Jobs run on one thread, retrieves (an engine waits on
them) before stores, each kind in submission order; the runs of a job are pipelined. The server cannot
remove or clear single keys: the tier does not offer either.
"""

from __future__ import annotations

import itertools
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
from kvcore.ports import BlockItem, OrderedMover, StoreItem
from kvcore.remote import close_quietly
from kvcore_lmcache.link import Segment, ServerLink, SlotLayout, join
from kvcore_lmcache.lookups import LookupBook
from kvcore_lmcache.values import BlockMovers, BlockValues, HostValues, Values
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


def _chain_of(items: Sequence[StoreItem | BlockItem], chain: Sequence[ChunkKey]) -> tuple[ChunkKey, ...]:
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

    ``host`` is the worker's host buffer for the ``ManagedTier`` calls (a writable buffer: ``bytearray``,
    a NumPy array's memory, a pinned tensor's storage). With ``block_movers``, the tier also moves whole
    chunks of ``value_bytes`` straight between the engine's blocks (``block_bytes`` each, every layer of
    the shard) and its slots (``SupportsBlockTransfer``). Construction never fails because the server is
    absent (see ``ServerLink``); it raises ``ConfigError`` when the server's chunk size is not
    ``chunk_tokens``.
    """

    def __init__(
        self,
        config: LMCacheMPConfig,
        host: memoryview | bytearray | None,
        *,
        value_bytes: int,
        chunk_tokens: int,
        model_name: str,
        block_movers: BlockMovers | None = None,
        block_bytes: int = 1,
    ) -> None:
        view = memoryview(host).cast("B") if host is not None else None
        if view is not None and view.readonly:
            raise InvalidSpecError("the host buffer must be writable")
        if value_bytes < 1:
            raise InvalidSpecError(f"value_bytes must be >= 1, got {value_bytes}")
        if block_bytes < 1 or value_bytes % block_bytes:
            raise InvalidSpecError(f"block_bytes must divide value_bytes ({value_bytes}), got {block_bytes}")
        self._host = view
        self.value_bytes = value_bytes
        self.blocks_per_value = value_bytes // block_bytes
        self._movers = block_movers
        # on the job thread: the block mover over the pool it was built for (None: none could be)
        self._mapped: tuple[Segment, OrderedMover | None] | None = None
        self.link = ServerLink(config, chunk_tokens, model_name, SlotLayout(value_bytes, block_bytes))
        self._lookups = LookupBook(self.link)
        self._board = JobBoard()
        self._lock = threading.Lock()
        self._held: dict[RequestId, dict[ChunkKey, _Hold]] = {}  # locked hits, by session and key
        self._stores: dict[JobId, Values] = {}  # store jobs not finished, for ``abandon``
        self._closing = False
        self._order = itertools.count()
        # retrieves (an engine waits on them) before stores; each kind in submission order
        self._queue: queue.PriorityQueue[tuple[int, int, JobId | None, _Job | None]] = queue.PriorityQueue()
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
        return self._submit(
            self._store, session, self._host_values(items), _chain_of(items, chain), store=True
        )

    def submit_retrieve(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        return self._submit(self._retrieve, session, self._host_values(items), _chain_of(items, chain))

    def submit_store_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        values = self._block_values(items, whole=True)
        return self._submit(self._store, session, values, _chain_of(items, chain), store=True)

    def submit_retrieve_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        values = self._block_values(items, whole=False)
        return self._submit(self._retrieve, session, values, _chain_of(items, chain))

    def abandon(self, job_id: JobId) -> None:
        """The engine may overwrite the blocks of store ``job_id`` from now on: unless its copies have
        already finished, it stores nothing (its slots get no valid header). Unknown jobs are ignored."""
        with self._lock:
            values = self._stores.get(job_id)
        if values is not None:
            values.abandoned.set()

    def close(self) -> None:
        """Fail the queued jobs at once (a job running now finishes, each wait bounded by the request
        timeout; the job thread is joined for at most two request timeouts and a second), stop the block
        mover (a job still running then starts no more copies), then drop the connection.
        Idempotent; a later submit raises ``BackendError`` (the worker fails its chunks at once)."""
        with self._lock:
            first, self._closing = not self._closing, True
            if first:
                self._queue.put((2, next(self._order), None, None))
        join(self._worker, 2 * self.link.config.request_timeout_s + 1.0)
        if self._mapped is not None:
            close_quietly(self._mapped[1])
            self._mapped = None
        self.link.close()

    def _host_values(self, items: Sequence[StoreItem]) -> HostValues:
        if self._host is None:
            raise InvalidSpecError("this tier has no host buffer: move engine blocks instead")
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
        return HostValues(self._host, tuple(items), self.link.layout, self.link.segment_lock)

    def _block_values(self, items: Sequence[BlockItem], *, whole: bool) -> BlockValues:
        """The items' values in engine blocks; a store moves whole chunks. On the engine's thread: the
        copies are ordered after the engine's work queued now."""
        movers = self._movers
        if movers is None:
            raise BackendError("this LMCache tier was opened without a block mover")
        size = self.blocks_per_value
        for i, item in enumerate(items):
            count = len(item.engine_blocks)
            if (whole and (item.first or count != size)) or count < 1 or item.first + count > size:
                raise InvalidSpecError(
                    f"item {i} ({item.key}): blocks [{item.first}, {item.first + count}) of a chunk of {size}"
                    + (" (a store moves whole chunks)" if whole else "")
                )
        patience = self.link.config.request_timeout_s
        return BlockValues(movers.mark(), tuple(items), self.link.layout, self._mover_over, patience)

    def _mover_over(self, pool: Segment) -> OrderedMover | None:
        """On the job thread: the block mover over ``pool``, built the first time it is asked for (the
        mover of a pool the heartbeat replaced is closed then)."""
        mapped = self._mapped
        if mapped is not None and mapped[0] is pool:
            return mapped[1]
        mover: OrderedMover | None = None
        with self.link.segment_lock:  # the heartbeat does not unmap the pool while the mover takes it
            if self._movers is None or pool.closed or self._closing:  # no new mover once closing
                return None
            try:
                mover = self._movers.over(pool.buffer)
            except BackendError as exc:
                log.warning("kvcore: no block mover over the LMCache pool: %s", exc)
        self._mapped = (pool, mover)
        if mapped is not None and mapped[1] is not None:
            close_quietly(mapped[1])
        return mover

    def _submit(
        self,
        job: Callable[[JobId, RequestId, Values, tuple[ChunkKey, ...]], JobResult],
        session: RequestId,
        values: Values,
        chain: tuple[ChunkKey, ...],
        *,
        store: bool = False,
    ) -> JobId:
        with self._lock:  # a job queued before the closing sentinel is still answered; none after it
            if self._closing:
                raise BackendError("the LMCache tier is closed")
            job_id = self._board.new()
            if store:
                self._stores[job_id] = values
            work = lambda: job(job_id, session, values, chain)  # noqa: E731  (the queue's entry)
            self._queue.put((1 if store else 0, next(self._order), job_id, work))
        return job_id

    def _run(self) -> None:
        while True:
            _, _, job_id, work = self._queue.get()
            if job_id is None or work is None:
                return
            try:
                result = work() if not self._closing else JobResult(job_id, error="the LMCache tier closed")
            except BackendError as exc:
                result = JobResult(job_id, error=str(exc))
            except Exception as exc:  # a bug must fail its job, not stop the thread every job waits on
                log.exception("kvcore: LMCache job %s failed", job_id)
                result = JobResult(job_id, error=repr(exc))
            with self._lock:
                self._stores.pop(job_id, None)
            self._board.finish(result)

    # -- store and retrieve (on the job thread) ----------------------------------------------------

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
        with self.link.segment_lock:
            pool = self.link.segment
        if not self.link.available() or pool is None or pool.closed or not values.ready(pool):
            return None
        return pool

    def _refused(self, job_id: JobId, values: Values) -> JobResult:
        """Every item of a job ``_pool`` refused failed, and why."""
        why = str(self.link.unavailable()) if not self.link.available() else "the LMCache pool is unusable"
        return JobResult(job_id, tuple(range(len(values.keys))), why)

    def _store(
        self, job_id: JobId, session: RequestId, values: Values, chain: tuple[ChunkKey, ...]
    ) -> JobResult:
        pool = self._pool(values)
        if pool is None:
            return self._refused(job_id, values)
        at, failed = self._placed(values.keys, chain)
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
        self.link.release(server, chain, ())
        return JobResult(job_id, tuple(sorted(set(failed))))

    def _retrieve(
        self, job_id: JobId, session: RequestId, values: Values, chain: tuple[ChunkKey, ...]
    ) -> JobResult:
        pool = self._pool(values)
        if pool is None:
            return self._refused(job_id, values)
        at, failed = self._placed(values.keys, chain)
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
        leftover = set(range(locked_here))
        commits: list[MessagingFuture[bool]] = []
        try:
            for (start, end), key, future in zip(runs, keys, prepared, strict=True):
                try:
                    failed.extend(
                        self._read_run(session, values, pool, at, holds, leftover, (start, end), future)
                    )
                finally:
                    # Every prepare gets its commit, after the run's copies: the commit ends the server's
                    # read, and the slot may be reused from then on. A reply that came too late still
                    # leaves the read pending, and the commit, on the same server thread, ends it.
                    commits.append(client.commit_retrieve(key, iid))
        finally:
            commits.extend(client.commit_retrieve(key, iid) for key in keys[len(commits) :])
        for commit in commits:
            self._reply(commit, "commit_retrieve")
        if lookup is not None:
            self.link.release(lookup, chain, _runs(leftover))
        self.link.release(server, chain, ())
        return JobResult(job_id, tuple(sorted(set(failed))))

    def _read_run(
        self,
        session: RequestId,
        values: Values,
        pool: Segment,
        at: dict[int, list[int]],
        holds: dict[int, _Hold],
        leftover: set[int],
        run: tuple[int, int],
        future: MessagingFuture[Any],
    ) -> list[int]:
        """Copy out the chain positions ``run`` (``[start, end)``) that ``future`` prepared; returns the
        items that failed. The locks the prepare consumed leave ``holds`` or ``leftover``."""
        start, end = run
        slots, consumed = self._prepared_slots(future)
        if consumed:  # a prepare consumed one lock per chunk of its run, whatever it found
            for pos in range(start, end):
                hold = holds.get(pos)
                if hold is None:
                    leftover.discard(pos)
                else:
                    self._unhold(session, hold, pos)
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

    def _slot_offset(self, slot: Any, pool: Segment) -> int | None:
        """A slot's offset in ``pool``, if the slot is one of this layout's and lies inside the pool."""
        try:
            offset, length = int(slot["offset"]), int(slot["length"])
        except (KeyError, TypeError, ValueError):
            return None
        inside = offset >= 0 and offset + length <= pool.size
        return offset if inside and length == self.link.layout.slot_bytes else None

    def _seal(self, offset: int, raw: bytes | None, pool: Segment) -> bool:
        """Write the header of the slot at ``offset``; ``None`` writes a zeroed one, which never reads as
        a value. False: the pool was unmapped meanwhile (nothing written)."""
        with self.link.segment_lock:
            if pool.closed:
                return False
            pool.view[offset : offset + HEADER_BYTES] = raw if raw is not None else bytes(HEADER_BYTES)
        return True

    def _holds(self, offset: int, key: ChunkKey, length: int, pool: Segment) -> bool:
        """Whether the slot at ``offset`` holds a ``length``-byte value stored under ``key``."""
        with self.link.segment_lock:
            if pool.closed:
                return False
            return check_header(key, length, bytes(pool.view[offset : offset + HEADER_BYTES]))
