"""Lookups on an LMCache server without blocking the caller: submit, then poll until answered.

A server lookup is two rounds: ``lookup`` (starts a prefetch and read-locks the hits) and, once that
is acknowledged, ``query_prefetch_status`` (the hit count). Querying before the acknowledgement can
overtake the lookup on the server and answer a false miss whose locks are never released, so the
second round waits for the first. Each key is its own server lookup (see ``kvcore_lmcache.wire``);
all of them are in flight at once. The answer is one flag per key; the caller owns the locks of the
hits from then on and releases them through ``ServerLink.release``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

from lmcache.v1.multiprocess.futures import MessagingFuture

from kvcore.errors import BackendError, TransferTimeout, UsageError
from kvcore.ids import ChunkKey, LookupId, RequestId
from kvcore_lmcache.link import ServerLink

__all__ = ["LookupBook", "LookupState"]


class LookupState:
    """One lookup in flight (a plain slotted record: it lives on the lookup hot path)."""

    __slots__ = ("acks", "deadline", "keys", "session", "statuses")

    def __init__(self, session: RequestId, keys: tuple[ChunkKey, ...], deadline: float) -> None:
        self.session = session
        self.keys = keys
        self.deadline = deadline
        self.acks: list[MessagingFuture[Any]] = []
        self.statuses: list[MessagingFuture[int | None]] | None = None


class LookupBook:
    """Lookups in flight for one link, by id."""

    def __init__(self, link: ServerLink) -> None:
        self._link = link
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[LookupId, LookupState] = {}

    def submit(self, session: RequestId, keys: Sequence[ChunkKey]) -> LookupId:
        """Send one server lookup per key. Raises ``BackendUnavailable`` when the link is down."""
        self._link.require()
        codec, client = self._link.codec, self._link.client
        state = LookupState(session, tuple(keys), time.monotonic() + self._link.config.request_timeout_s)
        state.acks = [client.lookup(codec.ipc_key(session, key, None), 1) for key in state.keys]
        with self._lock:
            lookup_id = LookupId(next(self._ids))
            self._pending[lookup_id] = state
        return lookup_id

    def poll(self, lookup_id: LookupId) -> tuple[LookupState, tuple[bool, ...]] | None:
        """The lookup and one flag per key once every key answered, else ``None``; handed out once.

        Past its deadline the lookup is dropped (its keys' server sessions released) and
        ``TransferTimeout`` is raised; an error reply raises ``BackendError``. ``UsageError`` for an
        unknown id.
        """
        with self._lock:
            state = self._pending.get(lookup_id)
        if state is None:
            raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
        try:
            flags = self._advance(state)
        except BackendError:
            self.cancel(lookup_id)
            raise
        if flags is None:
            if time.monotonic() < state.deadline:
                return None
            self.cancel(lookup_id)
            self._link.failed(f"lookup of {len(state.keys)} keys unanswered")
            raise TransferTimeout(f"LMCache lookup {lookup_id} unanswered after its deadline")
        with self._lock:
            self._pending.pop(lookup_id, None)
        return state, flags

    def _advance(self, state: LookupState) -> tuple[bool, ...] | None:
        if state.statuses is None:
            if not all(ack.query() for ack in state.acks):
                return None
            for ack in state.acks:
                self._link.result(ack, "lookup", timeout=0)
            client = self._link.client
            state.statuses = [
                client.query_prefetch_status(self._link.codec.server_session(state.session, key))
                for key in state.keys
            ]
        if not all(status.query() for status in state.statuses):
            return None
        counts = [self._link.result(status, "query_prefetch_status", timeout=0) for status in state.statuses]
        # None: the prefetch still runs; ask again (a fresh query: a reply is handed out once).
        if any(count is None for count in counts):
            client = self._link.client
            state.statuses = [
                client.query_prefetch_status(self._link.codec.server_session(state.session, key))
                if count is None
                else status
                for key, count, status in zip(state.keys, counts, state.statuses, strict=True)
            ]
            return None
        return tuple(bool(count) for count in counts)

    def cancel(self, lookup_id: LookupId) -> None:
        """Forget a lookup and release its keys' server sessions (locks a running prefetch still
        holds expire with the server's read-lock TTL). Unknown ids are ignored."""
        with self._lock:
            state = self._pending.pop(lookup_id, None)
        if state is not None:
            for key in state.keys:
                self._link.release(state.session, key, locked=True)

    def cancel_session(self, session: RequestId) -> None:
        """Cancel every lookup of ``session``."""
        with self._lock:
            ids = [i for i, s in self._pending.items() if s.session == session]
        for lookup_id in ids:
            self.cancel(lookup_id)
