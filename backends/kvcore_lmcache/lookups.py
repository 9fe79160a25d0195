"""Lookups on an LMCache server without blocking the caller: submit, then poll until answered.

A lookup names one or more chains (the scheduler's index sends one per shard, a worker one); each chain
is one server lookup in its own server session, all in flight at once. A server lookup is two rounds:
``lookup`` (starts a prefetch and read-locks the hits) and, once that is acknowledged,
``query_prefetch_status`` (how many leading chunks of the chain hit). Querying before the
acknowledgement can overtake the lookup on the server and answer a false miss whose locks are never
released, so the second round waits for the first. The caller owns the locks of the hits from then on
and releases them through ``ServerLink.release``.
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

__all__ = ["ROUNDS_CAP", "LookupBook", "LookupState"]

ROUNDS_CAP = 10
"""Request timeouts a lookup may take in all while its server keeps answering "still prefetching"."""


class LookupState:
    """One lookup in flight (a plain slotted record: it lives on the lookup hot path).

    ``first`` is where the asked chunks start in each chain (the chunks before it are context).
    """

    __slots__ = ("acks", "begun", "chains", "first", "sent", "servers", "session", "statuses")

    def __init__(
        self,
        session: RequestId,
        chains: tuple[tuple[ChunkKey, ...], ...],
        servers: tuple[str, ...],
        first: int,
        sent: float,
    ) -> None:
        self.session = session
        self.chains = chains
        self.servers = servers
        self.first = first
        self.sent = sent  # when its latest round went out (monotonic): its silence counts from there
        self.begun = sent  # when its first round went out: ``ROUNDS_CAP`` request timeouts at most in all
        self.acks: list[MessagingFuture[Any]] = []
        self.statuses: list[MessagingFuture[int | None]] | None = None


class LookupBook:
    """Lookups in flight for one link, by id."""

    def __init__(self, link: ServerLink) -> None:
        self._link = link
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[LookupId, LookupState] = {}

    def submit(self, session: RequestId, chains: Sequence[Sequence[ChunkKey]], first: int = 0) -> LookupId:
        """Send one server lookup per chain. Raises ``BackendUnavailable`` when the link is down."""
        self._link.require()
        lookup_id = LookupId(next(self._ids))
        codec = self._link.codec
        servers = tuple(self._link.server_session(session, f"l{lookup_id}.{i}") for i in range(len(chains)))
        state = LookupState(
            session,
            tuple(tuple(chain) for chain in chains),
            servers,
            first,
            time.monotonic(),
        )
        client = self._link.client
        state.acks = [
            client.lookup(codec.ipc_key(server, chain, 0, len(chain), None), 1)
            for server, chain in zip(servers, state.chains, strict=True)
        ]
        with self._lock:
            self._pending[lookup_id] = state
        return lookup_id

    def poll(self, lookup_id: LookupId) -> tuple[LookupState, tuple[int, ...]] | None:
        """The lookup and, per chain, its leading chunks hit once every chain answered, else ``None``;
        handed out once.

        Once a round has gone unanswered past the request timeout the lookup is dropped (its locks
        released) and ``TransferTimeout`` is raised;
        an error reply raises ``BackendError``. ``UsageError`` for an unknown id.
        """
        with self._lock:
            state = self._pending.get(lookup_id)
        if state is None:
            raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
        try:
            hits = self._advance(state)
        except BackendError:
            self.cancel(lookup_id)
            raise
        if hits is None:
            timeout = self._link.config.request_timeout_s
            now = time.monotonic()
            if now < state.sent + timeout and now < state.begun + ROUNDS_CAP * timeout:
                # An engine polls from a busy loop; yielding the GIL once lets the client's reply thread
                # hand over what arrived (measured in vLLM: a 24-chunk lookup took 100 ms without, 60 with).
                time.sleep(0)
                return None
            self.cancel(lookup_id)
            self._link.failed(f"lookup of {len(state.chains)} chains unanswered")
            raise TransferTimeout(f"LMCache lookup {lookup_id} unanswered after its deadline")
        with self._lock:
            if self._pending.pop(lookup_id, None) is None:  # cancelled meanwhile: its locks are gone
                raise UsageError(f"lookup {lookup_id} was cancelled")
        return state, hits

    def _advance(self, state: LookupState) -> tuple[int, ...] | None:
        client = self._link.client
        if state.statuses is None:
            if not all(ack.query() for ack in state.acks):
                return None
            for ack in state.acks:
                self._link.result(ack, "lookup", timeout=0)
            state.statuses = [client.query_prefetch_status(server) for server in state.servers]
            state.sent = time.monotonic()
        if not all(status.query() for status in state.statuses):
            return None
        counts = [self._link.result(status, "query_prefetch_status", timeout=0) for status in state.statuses]
        # None: the prefetch still runs; ask again (a fresh query: a reply is handed out once).
        if any(count is None for count in counts):
            state.statuses = [
                client.query_prefetch_status(server) if count is None else status
                for server, count, status in zip(state.servers, counts, state.statuses, strict=True)
            ]
            state.sent = time.monotonic()
            return None
        return tuple(
            min(max(int(count or 0), 0), len(chain))
            for count, chain in zip(counts, state.chains, strict=True)
        )

    def progress(self, lookup_id: LookupId) -> float | None:
        """When the lookup's latest round went out (the server answered the one before), or ``None``
        for an unknown id: what bounds its silence (each round gets the request timeout)."""
        with self._lock:
            state = self._pending.get(lookup_id)
        return None if state is None else state.sent

    def cancel(self, lookup_id: LookupId) -> None:
        """Forget a lookup and release its locks (those a running prefetch still holds expire with the
        server's read-lock TTL). Unknown ids are ignored."""
        with self._lock:
            state = self._pending.pop(lookup_id, None)
        if state is not None:
            for server, chain in zip(state.servers, state.chains, strict=True):
                self._link.release(server, chain, ((0, len(chain)),))

    def cancel_session(self, session: RequestId) -> None:
        """Cancel every lookup of ``session``."""
        with self._lock:
            ids = [i for i, s in self._pending.items() if s.session == session]
        for lookup_id in ids:
            self.cancel(lookup_id)
