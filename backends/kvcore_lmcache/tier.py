"""``LMCacheManagedTier``: kvcore's ``ManagedTier`` port on an LMCache multiprocess server.

Worker side. Values move between the server's shared-memory slots (engine-driven mode with
``--shm-name``) and either the engine's KV blocks, copied by a block mover over the server's pool
(``SupportsBlockTransfer``: nothing of the engine's stands between), or one host buffer of the worker's
(``StoreItem`` offsets index it: the ``ManagedTier`` calls). The tier is chained (see
``kvcore_lmcache.wire``): every call names the request's chain.

With a value per KV head (the rank holds several, ``heads``), each call's values are split into one
per head, each head in a chain of its own (``kvcore_lmcache.heads``): a job then runs one part per head,
and an item fails where any of its heads failed.

This module is the façade: it checks what a call hands in and queues the job on a ``JobLane``,
retrieves (reads: an engine waits on them) before stores, each kind in submission order. The jobs
themselves are ``kvcore_lmcache.slot_io``'s; the read locks that lookups take and retrieves consume are
kept per session by ``kvcore_lmcache.sessions``. The server cannot remove or clear single keys: the tier
does not offer either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from functools import partial

from kvcore.errors import BackendError, BackendUnavailable, InvalidSpecError
from kvcore.ids import ChunkKey, JobId, LookupId, RequestId
from kvcore.jobs import JobBoard, JobResult
from kvcore.kit.closing import close_quietly
from kvcore.kit.lane import JobLane, Priority
from kvcore.model.head_runs import HeadRuns
from kvcore.ports import BlockItem, BlockMovers, OrderedMover, StoreItem
from kvcore_lmcache.config import LMCacheMPConfig
from kvcore_lmcache.heads import HOLDER_SEPARATOR, HeadSplit
from kvcore_lmcache.link import Segment, ServerLink, SlotLayout
from kvcore_lmcache.lookups import LookupBook
from kvcore_lmcache.sessions import SessionLocks
from kvcore_lmcache.slot_io import SlotIO
from kvcore_lmcache.values import BlockValues, HostValues, Values

__all__ = ["LMCacheManagedTier"]

log = logging.getLogger(__name__)

_Job = Callable[[JobId, RequestId, Values, tuple[ChunkKey, ...], Callable[[JobResult], object], int], None]
"""A job's part: it hands its result to the callable it is given, once (a retrieve before it is over)."""

_Parts = list[tuple[Values, tuple[ChunkKey, ...]]]
"""A job's parts: the values of each KV head (or the one part) and the chain they are keyed in."""


def _chain_of(items: Sequence[StoreItem | BlockItem], chain: Sequence[ChunkKey]) -> tuple[ChunkKey, ...]:
    """The chain a call names; none: its items' keys, in order (the port's default)."""
    return tuple(chain) if chain else tuple(item.key for item in items)


class _Joined:
    """The parts of one job telling their results: the job's, handed to ``finish`` once all told."""

    def __init__(self, job_id: JobId, parts: int, finish: Callable[[JobResult], object]) -> None:
        self._job_id = job_id
        self._left = parts
        self._finish = finish
        self._lock = threading.Lock()
        self._failed: set[int] = set()
        self._errors: list[str] = []

    def tell(self, result: JobResult, items: int) -> None:
        """A part of ``items`` items told ``result``."""
        with self._lock:
            self._failed.update(result.failed_items(items))
            if result.error is not None:
                self._errors.append(result.error)
            self._left -= 1
            if self._left:
                return
        self._finish(JobResult(self._job_id, tuple(sorted(self._failed)), "; ".join(self._errors) or None))


class LMCacheManagedTier:
    """A ``ManagedTier`` over an LMCache server, for values of at most ``value_bytes`` each.

    ``host`` is the worker's host buffer for the ``ManagedTier`` calls (a writable buffer: ``bytearray``,
    a NumPy array's memory, a pinned tensor's storage). With ``block_movers``, the tier also moves whole
    chunks of ``value_bytes`` straight between the engine's blocks (``block_bytes`` each, every layer of
    the shard) and its slots (``SupportsBlockTransfer``), and tails of fewer blocks. With ``heads`` (the
    rank's KV heads, several, for a server that keeps a value per head) ``value_bytes`` and
    ``block_bytes`` are one head's, and a call's keys are each value's heads' keys joined. Construction
    never fails because the server is absent (see ``ServerLink``); it raises ``ConfigError`` when the
    server's chunk size is not ``chunk_tokens``.
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
        heads: HeadRuns | None = None,
    ) -> None:
        view = memoryview(host).cast("B") if host is not None else None
        if view is not None and view.readonly:
            raise InvalidSpecError("the host buffer must be writable")
        if value_bytes < 1:
            raise InvalidSpecError(f"value_bytes must be >= 1, got {value_bytes}")
        if block_bytes < 1 or value_bytes % block_bytes:
            raise InvalidSpecError(f"block_bytes must divide value_bytes ({value_bytes}), got {block_bytes}")
        self._host = view
        self._split = HeadSplit(heads) if heads is not None and heads.heads > 1 else None
        self.value_bytes = value_bytes
        self.blocks_per_value = value_bytes // block_bytes
        self._movers = block_movers
        # the block mover over the pool it was built for (None: none could be), under ``_mover_lock``
        self._mapped: tuple[Segment, OrderedMover | None] | None = None
        self._mover_lock = threading.Lock()
        self.link = ServerLink(config, chunk_tokens, model_name, SlotLayout(value_bytes, block_bytes))
        self._lookups = LookupBook(self.link)
        self._locks = SessionLocks(self.link)
        self._slots = SlotIO(self.link, self._lookups, self._locks)
        self._board = JobBoard()
        self._lock = threading.Lock()
        self._jobs: dict[JobId, tuple[Values, ...]] = {}  # jobs not finished, for ``abandon``
        self._closing = False
        self._lane = JobLane("kvcore-lmcache-jobs")

    # -- lookups -----------------------------------------------------------------------------------

    def submit_lookup(
        self, session: RequestId, chunks: Sequence[ChunkKey], preceding: Sequence[ChunkKey] = ()
    ) -> LookupId:
        self._check_open()
        return self._lookups.submit(session, self._chains((*preceding, *chunks)), len(preceding))

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        self._check_open()
        answer = self._lookups.poll(lookup_id)
        if answer is None:
            return None
        state, hits = answer
        first, hit = state.first, min(hits)
        end = max(hit, first)
        # the chunks before ``first`` are held nearer by the caller, and a head's hits past the others'
        # are of no use: their locks go at once
        for server, chain, own in zip(state.servers, state.chains, hits, strict=True):
            released = [(start, stop) for start, stop in ((0, first), (end, own)) if start < stop]
            self._locks.keep(state.session, server, chain, range(first, end), released)
        return max(hit - first, 0)

    def adopt(self, session: RequestId, holder: str, chain: Sequence[ChunkKey], start: int, end: int) -> None:
        """Take over the read locks a scheduler's held lookup took in server session ``holder``
        (``LMCacheChunkIndex``): the session's next retrieve reads those chunks without a lookup."""
        if not 0 <= start < end <= len(chain) or not holder:
            log.warning(
                "kvcore: locks on chunks [%d, %d) of a %d-key chain left to lapse", start, end, len(chain)
            )
            return
        # taken by the scheduler's lookup up to ``lock_handover_s`` before its hand-over: as old as that
        at = time.monotonic() - self.link.config.lock_handover_s
        holders = holder.split(HOLDER_SEPARATOR) if self._split is not None else [holder]
        try:
            chains = self._chains(chain[:end])
        except InvalidSpecError as exc:
            chains = []
            log.warning("kvcore: %s", exc)
        if len(holders) != len(chains):
            log.warning("kvcore: locks of %d holders for %d KV heads released", len(holders), len(chains))
            for one in holders:  # ending a server session releases what it holds
                self.link.release(one, (), ())
            return
        for one, head_chain in zip(holders, chains, strict=True):
            self._locks.adopt(session, one, head_chain, range(start, end), at)

    def end_session(self, session: RequestId) -> None:
        self._lookups.cancel_session(session)
        self._locks.end(session)

    # -- jobs --------------------------------------------------------------------------------------

    def poll(self) -> tuple[JobResult, ...]:
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._board.wait(job_ids, timeout)

    def submit_store(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        parts = self._host_parts(items, _chain_of(items, chain))
        return self._submit(self._store, session, parts, store=True)

    def submit_retrieve(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        return self._submit(self._slots.retrieve, session, self._host_parts(items, _chain_of(items, chain)))

    def submit_store_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        parts = self._block_parts(items, _chain_of(items, chain), whole=True)
        return self._submit(self._store, session, parts, store=True)

    def submit_retrieve_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        parts = self._block_parts(items, _chain_of(items, chain), whole=False)
        return self._submit(self._slots.retrieve, session, parts)

    def abandon(self, job_id: JobId) -> bool:
        """The engine may overwrite the blocks of job ``job_id`` from now on: a store whose copies have
        not finished stores nothing (its slots get no valid header); a retrieve starts no copy into
        them (its items not yet copied fail). Returns whether a retrieve's copy into them is running
        (``SupportsBlockTransfer.abandon``). Unknown or finished jobs are ignored."""
        with self._lock:
            parts = self._jobs.get(job_id, ())
        running = [values.abandon() for values in parts]  # every part abandoned, running or not
        return any(running)

    def close(self) -> None:
        """Fail the queued jobs at once (a job running now finishes, each wait bounded by the request
        timeout; the job thread is joined for at most two request timeouts and a second), stop the block
        mover (a job still running then starts no more copies), then drop the connection.
        Idempotent; a later submit raises ``BackendUnavailable`` (the worker fails its chunks at once),
        and so does ``poll_lookup``: pending lookups are dropped."""
        with self._lock:
            self._closing = True
        self._lane.close(2 * self.link.config.request_timeout_s + 1.0, why="the LMCache tier closed")
        if self._mapped is not None:
            close_quietly(self._mapped[1])
            self._mapped = None
        self.link.close()

    def _check_open(self) -> None:
        if self._closing:
            raise BackendUnavailable("the LMCache tier is closed")

    def _chains(self, chain: Sequence[ChunkKey]) -> list[tuple[ChunkKey, ...]]:
        """The chain of each part of a call: each head's, or the chain itself."""
        return [tuple(chain)] if self._split is None else self._split.chains(chain)

    def _host_parts(self, items: Sequence[StoreItem], chain: tuple[ChunkKey, ...]) -> _Parts:
        host = self._checked_host(items)
        lock, layout = self.link.segment_lock, self.link.layout
        if self._split is None:
            return [(HostValues(host, tuple(items), layout, lock), chain)]
        per_head = self._split.store_items(items)
        return [
            (HostValues(host, tuple(head_items), layout, lock), head_chain)
            for head_items, head_chain in zip(per_head, self._split.chains(chain), strict=True)
        ]

    def _checked_host(self, items: Sequence[StoreItem]) -> memoryview:
        """The host buffer, once the items are checked to lie in it and fit a slot."""
        if self._host is None:
            raise InvalidSpecError("this tier has no host buffer: move engine blocks instead")
        size = len(self._host)
        heads = 1 if self._split is None else self._split.heads
        for i, item in enumerate(items):
            if item.offset < 0 or item.length < 1 or item.offset + item.length > size:
                raise InvalidSpecError(
                    f"item {i} ({item.key}) spans [{item.offset}, {item.offset + item.length}), "
                    f"outside the host buffer of {size} bytes"
                )
            if item.length > self.value_bytes * heads:
                raise InvalidSpecError(
                    f"item {i} ({item.key}) has {item.length} bytes; slots hold {self.value_bytes * heads}"
                )
        return self._host

    def _block_parts(self, items: Sequence[BlockItem], chain: tuple[ChunkKey, ...], *, whole: bool) -> _Parts:
        """The items' values in engine blocks (each head's: head blocks); a store moves whole chunks. On
        the engine's thread: the copies are ordered after the engine's work queued now."""
        movers = self._movers
        if movers is None:
            raise BackendError("this LMCache tier was opened without a block mover")
        size = self.blocks_per_value
        for i, item in enumerate(items):
            count = len(item.engine_blocks)
            blocks = size if item.value_blocks is None else item.value_blocks
            if blocks > size:
                raise InvalidSpecError(f"item {i} ({item.key}): value_blocks {blocks}, slots hold {size}")
            if (whole and (item.first or count != blocks)) or count < 1 or item.first + count > blocks:
                raise InvalidSpecError(
                    f"item {i} ({item.key}): blocks [{item.first}, {item.first + count}) of a value of "
                    f"{blocks}" + (" (a store moves whole values)" if whole else "")
                )
        patience, layout, mark = self.link.config.request_timeout_s, self.link.layout, movers.mark()
        if self._split is None:
            return [(BlockValues(mark, tuple(items), layout, self._mover_over, patience), chain)]
        per_head = self._split.block_items(items)
        return [
            (BlockValues(mark, tuple(head_items), layout, self._mover_over, patience, head), head_chain)
            for head, (head_items, head_chain) in enumerate(
                zip(per_head, self._split.chains(chain), strict=True)
            )
        ]

    def _mover_over(self, pool: Segment) -> OrderedMover | None:
        """The block mover over ``pool``, built the first time a job asks for it (the mover of a pool the
        heartbeat replaced is closed then); one, whichever of a job's parts asks first (a second mover
        would page-lock the pool twice)."""
        with self._mover_lock:
            mapped = self._mapped
            if mapped is not None and mapped[0] is pool:
                return mapped[1]
            mover: OrderedMover | None = None
            with self.link.segment_lock:  # the heartbeat does not unmap the pool while the mover takes it
                if self._movers is None or pool.closed or self._closing:  # no new mover once closing
                    return None
                try:
                    mover = self._movers.over(pool.buffer, per_head=self._split is not None)
                except BackendError as exc:
                    log.warning("kvcore: no block mover over the LMCache pool: %s", exc)
            self._mapped = (pool, mover)
        if mapped is not None and mapped[1] is not None:
            close_quietly(mapped[1])
        return mover

    def _submit(self, job: _Job, session: RequestId, parts: _Parts, *, store: bool = False) -> JobId:
        with self._lock:  # close sets ``_closing`` under it first: the lane is still open
            self._check_open()
            job_id = self._board.new()
            self._jobs[job_id] = tuple(values for values, _ in parts)
            run = partial(self._run, job, job_id, session, parts)
            self._lane.submit(run, partial(self._fail, job_id), Priority.WRITE if store else Priority.READ)
        return job_id

    def _store(
        self,
        job_id: JobId,
        session: RequestId,
        values: Values,
        chain: tuple[ChunkKey, ...],
        done: Callable[[JobResult], object],
        part: int,
    ) -> None:
        done(self._slots.store(job_id, session, values, chain, part))

    def _run(self, job: _Job, job_id: JobId, session: RequestId, parts: _Parts) -> None:
        """On the lane: run a job's parts side by side (the first on this thread, the others on threads
        of their own, which wait on the server most of their time), so that a load of several KV heads
        costs the round trips of one; its result is handed over once every part told its own (an item
        failed where a part failed it), and the lane moves on once every part ended: no copy of the job
        can touch an engine block after. A ``BackendError`` before a part's result fails that part's
        items (after: logged; anything else, a bug, the lane's)."""
        joined = _Joined(job_id, len(parts), self._finish)
        bugs: list[BaseException] = []

        def run(part: int) -> None:
            values, chain = parts[part]
            told = threading.Event()

            def done(result: JobResult) -> None:
                told.set()
                joined.tell(result, len(values.keys))

            try:
                job(job_id, session, values, chain, done, part)
            except BackendError as exc:
                if told.is_set():
                    log.warning("kvcore: LMCache job %s, after its result: %s", job_id, exc)
                else:
                    done(JobResult(job_id, tuple(range(len(values.keys))), str(exc)))
            except BaseException as exc:  # handed to the lane's thread, whose failure it is
                bugs.append(exc)

        # daemon threads, as the lane's: a copy waited out however long never holds the process's exit
        others = [
            threading.Thread(target=run, args=(part,), name=f"kvcore-lmcache-part-{part}", daemon=True)
            for part in range(1, len(parts))
        ]
        try:
            for other in others:
                other.start()
            run(0)
        finally:
            for other in others:
                if other.ident is not None:  # started
                    other.join()
        if bugs:
            raise bugs[0]

    def _fail(self, job_id: JobId, why: str) -> None:
        self._finish(JobResult(job_id, error=why))

    def _finish(self, result: JobResult) -> None:
        with self._lock:
            self._jobs.pop(result.job_id, None)
        self._board.finish(result)  # a second result of a job (it raised after its first) is ignored
