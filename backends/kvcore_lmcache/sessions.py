"""The read locks a worker's lookups hold on an LMCache server, kept per kvcore session.

A server lookup read-locks its hits in a server session of its own (``kvcore_lmcache.lookups``). The
tier keeps the locks of the chunks its caller may retrieve (``keep``), and takes over those a
scheduler's lookup took for it (``adopt``: the lock hand-over). A retrieve ``take``s the holds it reads
under, whole: from then on they are the retrieve's alone (a lock adopted meanwhile on the same chunks is
another hold), and it releases what it did not read once its commits are answered. Ending the kvcore
session releases the rest (``end``). A session keeps one lock per key: a later lock on a key replaces
the earlier one, which is released. Every release names when its lock was taken, so that one old
enough to have lapsed is left alone (``ServerLink.release``).
"""

from __future__ import annotations

import threading
import time
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
    ``chain`` at ``positions``, taken at ``at`` (monotonic). The server session ends with its release."""

    __slots__ = ("at", "chain", "positions", "server")

    def __init__(self, server: str, chain: tuple[ChunkKey, ...], positions: set[int], at: float) -> None:
        self.server = server
        self.chain = chain
        self.positions = positions
        self.at = at

    def release(self, link: ServerLink, *, end: bool = True) -> None:
        """Release what the hold still holds (and end its server session unless ``end`` is false)."""
        link.release(self.server, self.chain, runs(self.positions), end=end, taken_at=self.at)


class SessionLocks:
    """The locked hits of every kvcore session of one link, by session and key; thread-safe."""

    def __init__(self, link: ServerLink) -> None:
        self._link = link
        self._lock = threading.Lock()
        self._held: dict[RequestId, dict[ChunkKey, Hold]] = {}

    def keep(
        self,
        session: RequestId,
        server: str,
        chain: tuple[ChunkKey, ...],
        kept: Iterable[int],
        released: Iterable[tuple[int, int]],
        at: float | None = None,
    ) -> None:
        """Keep the locks of ``kept`` positions for the session (taken at ``at``, default now); release
        ``released`` ranges now (and end the server session if nothing is kept). A lock the session
        already held on one of the keys is released."""
        hold = Hold(server, chain, set(kept), time.monotonic() if at is None else at)
        if not hold.positions:
            self._link.release(server, chain, released, taken_at=hold.at)
            return
        self._link.release(server, chain, released, end=False, taken_at=hold.at)
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
            end = not old.positions
            self._link.release(old.server, old.chain, ((pos, pos + 1),), end=end, taken_at=old.at)

    def adopt(
        self, session: RequestId, server: str, chain: tuple[ChunkKey, ...], kept: Iterable[int], at: float
    ) -> None:
        """Keep the locks another client's lookup took (at ``at``, or earlier) in ``server`` on the
        chunks of ``chain`` at ``kept``."""
        self.keep(session, server, chain, kept, (), at)

    def take(
        self, session: RequestId, chain: tuple[ChunkKey, ...], positions: Iterable[int]
    ) -> dict[int, Hold]:
        """The session's holds on the chunks of ``chain`` at ``positions``, by position, taken out whole:
        the caller owns them (and must release them) from now on."""
        with self._lock:
            held = self._held.get(session, {})
            taken = {pos: held[chain[pos]] for pos in positions if chain[pos] in held}
            mine = {id(hold) for hold in taken.values()}
            for key in [key for key, hold in held.items() if id(hold) in mine]:
                del held[key]
            return taken

    def end(self, session: RequestId) -> None:
        """Release every lock the session still holds."""
        with self._lock:
            holds = {id(h): h for h in self._held.pop(session, {}).values()}
        for hold in holds.values():
            hold.release(self._link)
