"""``LMCacheManagedTier``: kvcore's ``ManagedTier`` port on an LMCache multiprocess server.

Worker side. Values move between the server's shared-memory slots (engine-driven mode with
``--shm-name``) and either the engine's KV blocks, copied by a block mover over the server's pool
(``SupportsBlockTransfer``: nothing of the engine's stands between), or one host buffer of the worker's
(``StoreItem`` offsets index it: the ``ManagedTier`` calls). The tier is chained (see
``kvcore_lmcache.wire``): a job's items are cut into runs of consecutive chunks of the request's chain,
and each run is one server request. A store reserves a run's slots (``prepare_store``), copies the
values in, writes each slot's header and commits; a retrieve maps the slots of a run of locked hits
(``prepare_retrieve``), checks each header, copies the values out and commits, which releases the read
locks. No tensor is ever pickled onto the socket. Jobs run in submission order on one thread; the runs
of a job are pipelined. The server cannot remove or clear single keys: the tier does not offer either.
"""

from __future__ import annotations

import abc
import logging
import mmap
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
from kvcore.ports import BlockItem, BlockTransfer, Direction, OrderedMover, StoreItem
from kvcore.remote import close_quietly
from kvcore_lmcache.link import Segment, ServerLink, SlotLayout
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


def _chain_of(items: Sequence[StoreItem | BlockItem], chain: Sequence[ChunkKey]) -> tuple[ChunkKey, ...]:
    """The chain a call names; none: its items' keys, in order (the port's default)."""
    return tuple(chain) if chain else tuple(item.key for item in items)


BlockMovers = Callable[[mmap.mmap], OrderedMover]
"""Builds a block mover between the engine's KV blocks and the server's mapped pool, seen as host blocks
of the layout's ``align`` bytes (``kvcore_cpu.tier.MappedMover``)."""


class _Values(abc.ABC):
    """Where a job's values come from and go to; ``put`` and ``get`` copy items ``i`` into and out of the
    value of the slot at pool offset ``slot`` for each ``(i, slot)`` pair, and return the items that
    failed. Slots are checked against the pool before; headers are the job's."""

    def __init__(self, keys: Sequence[ChunkKey], lengths: Sequence[int]) -> None:
        self.keys = tuple(keys)
        self.lengths = tuple(lengths)  # each item's value length, as its header states it

    @abc.abstractmethod
    def put(self, pairs: Sequence[tuple[int, int]]) -> set[int]: ...

    @abc.abstractmethod
    def get(self, pairs: Sequence[tuple[int, int]]) -> set[int]: ...


class _HostValues(_Values):
    """Values in the worker's host buffer (``StoreItem`` offsets)."""

    def __init__(self, link: ServerLink, host: memoryview, items: Sequence[StoreItem]) -> None:
        super().__init__([item.key for item in items], [item.length for item in items])
        self._link = link
        self._host = host
        self._items = items

    def put(self, pairs: Sequence[tuple[int, int]]) -> set[int]:
        return self._copy(pairs, into_pool=True)

    def get(self, pairs: Sequence[tuple[int, int]]) -> set[int]:
        return self._copy(pairs, into_pool=False)

    def _copy(self, pairs: Sequence[tuple[int, int]], *, into_pool: bool) -> set[int]:
        failed: set[int] = set()
        layout = self._link.layout
        with self._link.segment_lock:
            segment = self._link.segment
            for i, slot in pairs:
                item, at = self._items[i], layout.value_offset(slot)
                if segment is None or at + item.length > segment.size:
                    failed.add(i)
                elif into_pool:
                    segment.view[at : at + item.length] = self._host[item.offset : item.offset + item.length]
                else:
                    self._host[item.offset : item.offset + item.length] = segment.view[at : at + item.length]
        return failed


class _BlockValues(_Values):
    """Values in the engine's KV blocks, copied by a block mover over the server's pool; a value is
    ``blocks`` host blocks of the pool. ``mark`` orders the copies after the engine work queued when the
    job was submitted."""

    def __init__(
        self,
        mover: OrderedMover | None,
        mark: object,
        items: Sequence[BlockItem],
        layout: SlotLayout,
        patience: float,
    ) -> None:
        super().__init__([item.key for item in items], [layout.value_bytes] * len(items))
        self._mover = mover
        self._mark = mark
        self._items = items
        self._layout = layout
        self._patience = patience

    def put(self, pairs: Sequence[tuple[int, int]]) -> set[int]:
        return self._copy(pairs, Direction.SAVE)

    def get(self, pairs: Sequence[tuple[int, int]]) -> set[int]:
        return self._copy(pairs, Direction.LOAD)

    def _copy(self, pairs: Sequence[tuple[int, int]], direction: Direction) -> set[int]:
        if not pairs:
            return set()
        owner: list[int] = []
        engine: list[int] = []
        host: list[int] = []
        for i, slot in pairs:
            item = self._items[i]
            first = self._layout.value_offset(slot) // self._layout.align + item.first
            engine.extend(item.engine_blocks)
            host.extend(range(first, first + len(item.engine_blocks)))
            owner.extend([i] * len(item.engine_blocks))
        everything = {i for i, _ in pairs}
        if self._mover is None:
            return everything
        try:
            job = self._mover.submit_after(BlockTransfer(direction, engine, host), self._mark)
        except (InvalidSpecError, UsageError) as exc:
            log.warning("kvcore: LMCache block copy refused: %s", exc)
            return everything
        # The job may not end while a copy of it can still touch an engine block: wait it out.
        while True:
            try:
                (result,) = self._mover.wait([job], self._patience)
                break
            except TransferTimeout:
                log.warning("kvcore: LMCache block copy still running after %.1fs", self._patience)
        if result.error is not None:
            log.warning("kvcore: LMCache block copy failed: %s", result.error)
            return everything
        return {owner[k] for k in result.failed}


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
        self._mapped: tuple[Segment, OrderedMover] | None = None  # the block mover of the current pool
        self.link = ServerLink(config, chunk_tokens, model_name, SlotLayout(value_bytes, block_bytes))
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
        values, whole = self._host_values(items), _chain_of(items, chain)
        return self._submit(lambda job_id: self._store(job_id, session, values, whole))

    def submit_retrieve(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        values, whole = self._host_values(items), _chain_of(items, chain)
        return self._submit(lambda job_id: self._retrieve(job_id, session, values, whole))

    def submit_store_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        values, whole = self._block_values(items, whole=True), _chain_of(items, chain)
        return self._submit(lambda job_id: self._store(job_id, session, values, whole))

    def submit_retrieve_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        values, whole = self._block_values(items, whole=False), _chain_of(items, chain)
        return self._submit(lambda job_id: self._retrieve(job_id, session, values, whole))

    def close(self) -> None:
        """Stop the block copies, finish queued jobs (each bounded by the request timeout; their block
        copies fail), then drop the connection. Idempotent."""
        with self.link.segment_lock:
            mapped, self._mapped, self._movers = self._mapped, None, None
        if mapped is not None:
            close_quietly(mapped[1])
        self._queue.put(None)
        self._worker.join()
        self.link.close()

    def _host_values(self, items: Sequence[StoreItem]) -> _HostValues:
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
        return _HostValues(self.link, self._host, tuple(items))

    def _block_values(self, items: Sequence[BlockItem], *, whole: bool) -> _BlockValues:
        """The items' values in engine blocks; a store moves whole chunks. On the engine's thread: the
        copies are ordered after the engine's work queued now."""
        if self._movers is None:
            raise BackendError("this LMCache tier has no block mover (opened without one, or closed)")
        size = self.blocks_per_value
        for i, item in enumerate(items):
            count = len(item.engine_blocks)
            if (whole and (item.first or count != size)) or count < 1 or item.first + count > size:
                raise InvalidSpecError(
                    f"item {i} ({item.key}): blocks [{item.first}, {item.first + count}) of a chunk of {size}"
                    + (" (a store moves whole chunks)" if whole else "")
                )
        mover = self._current_mover(self._movers)
        mark = mover.mark() if mover is not None else None
        return _BlockValues(mover, mark, tuple(items), self.link.layout, self.link.config.request_timeout_s)

    def _current_mover(self, movers: BlockMovers) -> OrderedMover | None:
        """The block mover over the server's current pool (``None`` while none is mapped), built anew
        when the heartbeat mapped a restarted server's pool."""
        with self.link.segment_lock:
            segment, old = self.link.segment, self._mapped
            if segment is None or self._movers is None:  # unmapped, or closed
                return None
            if old is not None and old[0] is segment:
                return old[1]
            try:
                mover: OrderedMover | None = movers(segment.buffer)
            except BackendError as exc:
                log.warning("kvcore: no block mover over the LMCache pool: %s", exc)
                mover = None
            self._mapped = (segment, mover) if mover is not None else None
        if old is not None:
            close_quietly(old[1])
        return mover

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

    def _store(
        self, job_id: JobId, session: RequestId, values: _Values, chain: tuple[ChunkKey, ...]
    ) -> JobResult:
        if not self.link.available():
            return JobResult(job_id, tuple(range(len(values.keys))), "LMCache server unavailable")
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
                targets, offset = at.get(start + int(index), []), self._slot_offset(slot)
                if targets and offset is not None:
                    filled.append((targets, offset))
                else:
                    failed.extend(targets)
                    self._seal(slot, None)  # never commit a slot whose header could read as a value
            bad = values.put([(targets[0], offset) for targets, offset in filled])
            written: list[int] = []
            for targets, offset in filled:
                i = targets[0]
                # the header last: a slot whose copy did not finish never reads as this key's value
                self._seal(offset, None if i in bad else header(values.keys[i], values.lengths[i]))
                (failed if i in bad else written).extend(targets)
            commits.append((written, client.commit_store(key, iid, b"")))
        for written, commit in commits:
            if not self._reply(commit, "commit_store"):
                failed.extend(written)
        self.link.release(server, chain, ())
        return JobResult(job_id, tuple(sorted(set(failed))))

    def _retrieve(
        self, job_id: JobId, session: RequestId, values: _Values, chain: tuple[ChunkKey, ...]
    ) -> JobResult:
        if not self.link.available():
            return JobResult(job_id, tuple(range(len(values.keys))), "LMCache server unavailable")
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
            found: list[tuple[int, int]] = []  # (item, slot) of every item whose slot holds its key
            for pos, slot in zip(range(start, end), slots, strict=True):
                offset = self._slot_offset(slot)
                for i in at[pos]:
                    if offset is not None and self._holds(offset, values.keys[i], values.lengths[i]):
                        found.append((i, offset))
                    else:
                        failed.append(i)
            failed.extend(values.get(found))
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

    def _slot_offset(self, slot: Any) -> int | None:
        """A slot's offset in the pool, if the slot is one of this layout's and lies inside the pool."""
        try:
            offset, length = int(slot["offset"]), int(slot["length"])
        except (KeyError, TypeError, ValueError):
            return None
        with self.link.segment_lock:
            segment = self.link.segment
            inside = segment is not None and offset >= 0 and offset + length <= segment.size
        return offset if inside and length == self.link.layout.slot_bytes else None

    def _seal(self, slot: Any, raw: bytes | None) -> None:
        """Write a slot's header (``slot``: its offset, or the server's descriptor); ``None`` writes a
        zeroed one, which never reads as a value."""
        offset = slot if isinstance(slot, int) else self._slot_offset(slot)
        with self.link.segment_lock:
            segment = self.link.segment
            if offset is not None and segment is not None and offset + HEADER_BYTES <= segment.size:
                segment.view[offset : offset + HEADER_BYTES] = raw if raw is not None else bytes(HEADER_BYTES)

    def _holds(self, offset: int, key: ChunkKey, length: int) -> bool:
        """Whether the slot at ``offset`` holds a ``length``-byte value stored under ``key``."""
        with self.link.segment_lock:
            segment = self.link.segment
            if segment is None or offset + HEADER_BYTES > segment.size:
                return False
            return check_header(key, length, bytes(segment.view[offset : offset + HEADER_BYTES]))
