"""``SessionLocks`` over a link that records its releases: every lock is released once, by its owner.

A retrieve takes the holds it reads under whole, so a lock adopted while it runs (the request was
preempted, looked up and loaded again) is another hold: neither release takes the other's lock.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import cast

from kvcore.ids import ChunkKey, RequestId
from kvcore_lmcache.link import ServerLink
from kvcore_lmcache.sessions import SessionLocks

CHAIN = tuple(ChunkKey(f"sessions/{i}") for i in range(3))
SESSION = RequestId("r")


class Releases:
    """The link's ``release``, recorded: which server sessions' locks on which positions, and ends."""

    def __init__(self) -> None:
        self.locks: Counter[tuple[str, int]] = Counter()
        self.ended: list[str] = []

    def release(
        self,
        server_session: str,
        chain: Sequence[ChunkKey],
        ranges: Iterable[tuple[int, int]],
        *,
        end: bool = True,
        taken_at: float | None = None,
    ) -> None:
        for start, stop in ranges:
            self.locks.update((server_session, pos) for pos in range(start, stop))
        if end:
            self.ended.append(server_session)


def _locks() -> tuple[SessionLocks, Releases]:
    link = Releases()
    return SessionLocks(cast(ServerLink, link)), link


def test_a_lock_adopted_during_a_retrieve_is_not_the_retrieves_to_release() -> None:
    locks, link = _locks()
    locks.adopt(SESSION, "first", CHAIN, range(3), time.monotonic())
    taken = locks.take(SESSION, CHAIN, [1, 2])  # a retrieve reads chunks 1 and 2 under "first"
    assert {pos: hold.server for pos, hold in taken.items()} == {1: "first", 2: "first"}
    locks.adopt(SESSION, "second", CHAIN, range(3), time.monotonic())  # meanwhile: a new load's locks
    assert link.locks == Counter()  # "first" is the retrieve's: the adoption released none of it
    hold = taken[1]
    hold.positions -= {1, 2}  # the retrieve's prepare consumed them
    hold.release(cast(ServerLink, link))  # the retrieve's end: chunk 0, which it did not read
    assert link.locks == Counter({("first", 0): 1})
    assert link.ended == ["first"]
    locks.end(SESSION)  # "second" was never read: all of it, once
    assert link.locks == Counter({("first", 0): 1, ("second", 0): 1, ("second", 1): 1, ("second", 2): 1})
    assert link.ended == ["first", "second"]


def test_a_later_lock_on_a_held_chunk_replaces_the_earlier_one_which_is_released_once() -> None:
    locks, link = _locks()
    locks.keep(SESSION, "first", CHAIN, range(3), ())
    locks.adopt(SESSION, "second", CHAIN, [2], time.monotonic())
    assert link.locks == Counter({("first", 2): 1})
    assert link.ended == []  # "first" still holds chunks 0 and 1
    taken = locks.take(SESSION, CHAIN, [0, 1, 2])
    assert {pos: hold.server for pos, hold in taken.items()} == {0: "first", 1: "first", 2: "second"}
    assert locks.take(SESSION, CHAIN, [0, 1, 2]) == {}  # taken once
    locks.end(SESSION)
    assert link.locks == Counter({("first", 2): 1})  # the taken holds are their taker's to release
