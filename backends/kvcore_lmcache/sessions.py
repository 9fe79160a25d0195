"""The read locks a worker's lookups hold on an LMCache server, kept per kvcore session.

A server lookup read-locks its hits in a server session of its own (``kvcore_lmcache.lookups``). The
tier keeps the locks of the chunks its caller may retrieve (``keep``); a retrieve's prepare consumes
them (``consumed``); ending the kvcore session releases the rest (``end``). A session keeps one lock per
key: a later lookup's lock on a key replaces the earlier one, which is released. A server session ends
once none of its locks is left. Locks a scheduler's lookup took and handed over are *adopted*: kept the
same way, and what the session's next retrieve did not read is released once it ends
(``release_adopted``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvcore.ids import ChunkKey, RequestId
from kvcore_lmcache.link import ServerLink

__all__ = ["Hold", "SessionLocks", "runs"]


def runs(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted, distinct positions as maximal ranges ``[start, end)`` of consecutive ones."""
    ranges: list[tuple[int, int]] = []
    for pos in sorted(set(positions)):
        if ranges and ranges[-1][1] == pos:
            ranges[-1] = (ranges[-1][0], pos + 1)
        else:
            ranges.append((pos, pos + 1))
    return ranges


class Hold:
    """The read locks one lookup's server session still holds for a kvcore session: the chunks of
    ``chain`` at ``positions``. The server session ends once none is left."""

    __slots__ = ("chain", "positions", "server")

    def __init__(self, server: str, chain: tuple[ChunkKey, ...], positions: set[int]) -> None:
        self.server = server
        self.chain = chain
        self.positions = positions


class SessionLocks:
    """The locked hits of every kvcore session of one link, by session and key; thread-safe."""

    def __init__(self, link: ServerLink) -> None:
        self._link = link
        self._lock = threading.Lock()
        self._held: dict[RequestId, dict[ChunkKey, Hold]] = {}
        self._adopted: dict[RequestId, set[str]] = {}  # server sessions of the adopted locks

    def keep(
        self,
        session: RequestId,
        server: str,
        chain: tuple[ChunkKey, ...],
        kept: Iterable[int],
        released: Iterable[tuple[int, int]],
    ) -> None:
        """Keep the locks of ``kept`` positions for the session; release ``released`` ranges now (and
        end the server session if nothing is kept). A lock the session already held on one of the keys
        is released."""
        hold = Hold(server, chain, set(kept))
        if not hold.positions:
            self._link.release(server, chain, released)
            return
        self._link.release(server, chain, released, end=False)
        replaced: list[tuple[Hold, int]] = []
        with self._lock:
            held = self._held.setdefault(session, {})
            for pos in hold.positions:
                old = held.get(chain[pos])
                if old is not None:
                    old.positions.discard(pos)
                    replaced.append((old, pos))
                held[chain[pos]] = hold
        for old, pos in replaced:
            self._link.release(old.server, old.chain, ((pos, pos + 1),), end=not old.positions)

    def adopt(
        self, session: RequestId, server: str, chain: tuple[ChunkKey, ...], kept: Iterable[int]
    ) -> None:
        """Keep the locks another client's lookup took in ``server`` on the chunks of ``chain`` at
        ``kept``, until ``release_adopted``."""
        with self._lock:
            self._adopted.setdefault(session, set()).add(server)
        self.keep(session, server, chain, kept, ())

    def release_adopted(self, session: RequestId) -> None:
        """Release what the session's adopted locks still hold."""
        with self._lock:
            servers = self._adopted.pop(session, set())
            held = self._held.get(session, {})
            gone = [held.pop(key) for key in [k for k, hold in held.items() if hold.server in servers]]
            holds = {id(hold): hold for hold in gone}
        for hold in holds.values():
            self._link.release(hold.server, hold.chain, runs(hold.positions))

    def held(
        self, session: RequestId, chain: tuple[ChunkKey, ...], positions: Iterable[int]
    ) -> dict[int, Hold]:
        """The session's holds on the chunks of ``chain`` at ``positions``, by position."""
        with self._lock:
            held = self._held.get(session, {})
            return {pos: held[chain[pos]] for pos in positions if chain[pos] in held}

    def consumed(self, session: RequestId, hold: Hold, pos: int) -> bool:
        """A hold's lock at ``pos`` was consumed (by a retrieve's prepare). Returns whether none is left:
        the caller then ends its server session, once the retrieve committed (a commit names it)."""
        with self._lock:
            hold.positions.discard(pos)
            held = self._held.get(session)
            if held is not None and held.get(hold.chain[pos]) is hold:
                del held[hold.chain[pos]]
            return not hold.positions

    def end(self, session: RequestId) -> None:
        """Release every lock the session still holds."""
        with self._lock:
            self._adopted.pop(session, None)
            holds = {id(h): h for h in self._held.pop(session, {}).values()}
        for hold in holds.values():
            self._link.release(hold.server, hold.chain, runs(hold.positions))
