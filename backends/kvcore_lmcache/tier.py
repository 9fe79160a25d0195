"""``LMCacheManagedTier``: kvcore's ``ManagedTier`` port on an LMCache multiprocess server.

Worker side. Values move between one host buffer (``StoreItem`` offsets index it) and the server's
shared-memory slots (engine-driven mode with ``--shm-name``): a store reserves slots
(``prepare_store``), copies header and bytes in, and commits; a retrieve maps the slots of locked hits
(``prepare_retrieve``), checks the header, copies out and commits, which releases the read lock. No
tensor is ever pickled onto the socket. Jobs run in submission order on one thread; requests within a
job are pipelined. The server cannot remove or clear single keys: the tier does not offer either.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from lmcache.v1.multiprocess.futures import MessagingFuture

from kvcore.config import LMCacheMPConfig
from kvcore.errors import BackendError, InvalidSpecError
from kvcore.ids import ChunkKey, JobId, LookupId, RequestId
from kvcore.jobs import JobBoard, JobResult
from kvcore.ports import StoreItem
from kvcore_lmcache.link import ServerLink, SlotLayout
from kvcore_lmcache.lookups import LookupBook
from kvcore_lmcache.wire import HEADER_BYTES, check_header, header

__all__ = ["LMCacheManagedTier"]

log = logging.getLogger(__name__)

_Job = Callable[[], JobResult]


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
        self._locked: dict[RequestId, set[ChunkKey]] = {}
        self._queue: queue.SimpleQueue[tuple[JobId, _Job] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name="kvcore-lmcache-jobs", daemon=True)
        self._worker.start()

    # -- lookups -----------------------------------------------------------------------------------

    def submit_lookup(self, session: RequestId, chunks: Sequence[ChunkKey]) -> LookupId:
        return self._lookups.submit(session, chunks)

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        answer = self._lookups.poll(lookup_id)
        if answer is None:
            return None
        state, flags = answer
        hits = next((i for i, hit in enumerate(flags) if not hit), len(flags))
        with self._lock:
            self._locked.setdefault(state.session, set()).update(state.keys[:hits])
        # a hit after the first miss is of no use: release its lock now
        for key, hit in zip(state.keys[hits:], flags[hits:], strict=True):
            self.link.release(state.session, key, locked=hit)
        return hits

    def end_session(self, session: RequestId) -> None:
        self._lookups.cancel_session(session)
        with self._lock:
            keys = self._locked.pop(session, set())
        for key in keys:
            self.link.release(session, key, locked=True)

    # -- jobs --------------------------------------------------------------------------------------

    def poll(self) -> tuple[JobResult, ...]:
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._board.wait(job_ids, timeout)

    def submit_store(self, session: RequestId, items: Sequence[StoreItem]) -> JobId:
        items = self._checked(items)
        return self._submit(lambda job_id: self._store(job_id, session, items))

    def submit_retrieve(self, session: RequestId, items: Sequence[StoreItem]) -> JobId:
        items = self._checked(items)
        return self._submit(lambda job_id: self._retrieve(job_id, session, items))

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
            self._board.finish(result)

    # -- store and retrieve (on the job thread) ----------------------------------------------------

    def _store(self, job_id: JobId, session: RequestId, items: tuple[StoreItem, ...]) -> JobResult:
        if not self.link.available():
            return JobResult(job_id, tuple(range(len(items))), "LMCache server unavailable")
        codec, client, iid = self.link.codec, self.link.client, self.link.instance_id
        keys = [codec.ipc_key(session, item.key, 0) for item in items]
        prepared = [client.prepare_store(key, iid) for key in keys]
        failed: list[int] = []
        commits: list[tuple[int, MessagingFuture[bool]]] = []
        for i, (item, key, future) in enumerate(zip(items, keys, prepared, strict=True)):
            slots = self._slots(future, "prepare_store", lambda r: r.context)
            if slots is None:
                failed.append(i)
            elif not slots:  # already stored: a store is idempotent
                pass
            elif self._write(item, slots[0]):
                commits.append((i, client.commit_store(key, iid, b"")))
            else:
                failed.append(i)
        for i, commit in commits:
            if not self._reply(commit, "commit_store"):
                failed.append(i)
        for item in items:
            self.link.release(session, item.key, locked=False)
        return JobResult(job_id, tuple(sorted(failed)))

    def _retrieve(self, job_id: JobId, session: RequestId, items: tuple[StoreItem, ...]) -> JobResult:
        if not self.link.available():
            return JobResult(job_id, tuple(range(len(items))), "LMCache server unavailable")
        with self._lock:
            held = self._locked.setdefault(session, set())
            unlocked = [item.key for item in items if item.key not in held]
        if unlocked:  # a retrieve without a lookup: lock the keys first
            self._lock_now(session, unlocked)
        with self._lock:
            held = self._locked.setdefault(session, set())
            wanted = [i for i, item in enumerate(items) if item.key in held]
            held.difference_update(items[i].key for i in wanted)
        codec, client, iid = self.link.codec, self.link.client, self.link.instance_id
        keys = {i: codec.ipc_key(session, items[i].key, 0) for i in wanted}
        prepared = {i: client.prepare_retrieve(keys[i], iid) for i in wanted}
        failed = [i for i in range(len(items)) if i not in prepared]
        commits: list[MessagingFuture[bool]] = []
        for i, future in prepared.items():
            slots = self._slots(future, "prepare_retrieve", lambda r: r.context if r.success else {})
            if not slots or not self._read(items[i], slots[0]):
                failed.append(i)
            if slots:
                commits.append(client.commit_retrieve(keys[i], iid))
            else:
                self.link.release(session, items[i].key, locked=True)
        for commit in commits:
            self._reply(commit, "commit_retrieve")
        for i in prepared:
            self.link.release(session, items[i].key, locked=False)
        return JobResult(job_id, tuple(sorted(failed)))

    def _lock_now(self, session: RequestId, keys: Sequence[ChunkKey]) -> None:
        try:
            lookup_id = self._lookups.submit(session, keys)
            while (answer := self._lookups.poll(lookup_id)) is None:
                time.sleep(0.0005)
        except BackendError as exc:
            log.warning("kvcore: LMCache lookup before retrieve failed: %s", exc)
            return
        state, flags = answer
        with self._lock:
            hits = (key for key, hit in zip(state.keys, flags, strict=True) if hit)
            self._locked.setdefault(session, set()).update(hits)
        for key, hit in zip(state.keys, flags, strict=True):
            if not hit:
                self.link.release(session, key, locked=False)

    def _slots(
        self, future: MessagingFuture[Any], what: str, context: Callable[[Any], Any]
    ) -> list[Any] | None:
        try:
            reply = self.link.result(future, what)
        except BackendError as exc:
            log.warning("kvcore: %s", exc)
            return None
        slots = context(reply).get("slots") if isinstance(context(reply), dict) else None
        return slots if isinstance(slots, list) else None

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
