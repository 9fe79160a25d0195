"""The scheduler's side of the lock hand-over (``SupportsHeldLookups``), over a fake index that keeps
what a lookup answered: every ``HeldChunks`` the scheduler takes ends exactly once, handed to the
workers with the load that reads it or released, on every path a request can take.

The same paths against a real LMCache server: ``tests/lmcache/test_handover.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from kvcore.errors import InvalidSpecError
from kvcore.execution.remote import StoreRemote
from kvcore.execution.worker import BlockWorker
from kvcore.ids import ChunkKey, LookupId, RequestId
from kvcore.model.step import BlockOp, StepPlan
from kvcore.ports import Direction, HeldChunks, SupportsHeldLookups
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore.testing.memory import InMemoryChunkStore, InMemoryStoreIndex
from tests.unit.test_scheduler_remote import CONFIG, ENGINE, OTHER, TOKENS, Rig


class HoldingIndex(InMemoryStoreIndex):
    """The store's reference index, with held lookups that keep their answer under one holder name per
    rank, counting each ``HeldChunks`` taken, handed over and released."""

    def __init__(self, store: InMemoryChunkStore) -> None:
        super().__init__(store.exists)
        self.lookups = 0
        self.fresh = True  # whether a hand-over is accepted
        self._answered: dict[LookupId, HeldChunks] = {}
        self.taken: Counter[HeldChunks] = Counter()
        self.handed: Counter[HeldChunks] = Counter()
        self.released: Counter[HeldChunks] = Counter()

    def submit_held_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        lookup_id = self.submit_lookup(chunks, preceding)
        self.lookups += 1
        start = len(preceding)
        holders = tuple(f"lookup{self.lookups}.rank{r}" for r in range(len(chunks[0])))
        # a miss is kept too, so that the scheduler's release of it is seen
        self._answered[lookup_id] = HeldChunks(holders, start, start + max(self._count(chunks), 1))
        return lookup_id

    def take_held(self, lookup_id: LookupId) -> HeldChunks | None:
        held = self._answered.pop(lookup_id, None)
        if held is not None:
            self.taken[held] += 1
        return held

    def hand_over(self, held: HeldChunks) -> bool:
        if self.fresh:
            self.handed[held] += 1
        else:
            self.released[held] += 1
        return self.fresh

    def release_held(self, held: HeldChunks) -> None:
        self.released[held] += 1

    def settled(self) -> bool:
        """Every lock answered was taken, and every lock taken ended exactly once."""
        ended = self.handed + self.released
        return not self._answered and self.taken == ended and not (set(self.handed) & set(self.released))


class Adopting(StoreRemote):
    """Records the locks the worker takes over."""

    adopted: list[tuple[str, str, tuple[ChunkKey, ...], int, int]]

    def adopt(self, session: str, holder: str, chain: Sequence[ChunkKey], start: int, end: int) -> None:
        self.adopted.append((session, holder, tuple(chain), start, end))


def _rig(slots: int = 3) -> tuple[Rig, HoldingIndex, Adopting]:
    rig = Rig(slots=slots)
    index = HoldingIndex(rig.store)
    assert isinstance(index, SupportsHeldLookups)
    rig.index = index
    rig.sched = CacheScheduler(CONFIG, ENGINE, slots, remote=index)
    remote = Adopting(rig.store)
    remote.adopted = []
    rig.worker = BlockWorker(
        rig.mover, remote=remote, slot_bytes=2 * rig.mover.host_block_bytes, slot_blocks=2
    )
    return rig, index, remote


def _evicted(rig: Rig, index: HoldingIndex) -> None:
    """TOKENS' three chunks are in the store and no longer in the 3-slot pool; the misses of the
    requests that saved them are settled and forgotten."""
    rig.serve_and_save("a", TOKENS, range(8))
    rig.serve_and_save("b", OTHER, range(8, 16))
    assert index.settled()
    index.taken.clear()
    index.released.clear()


def _load(rig: Rig, rid: str) -> BlockOp:
    rig.sched.start_load(RequestId(rid), range(20, 28))
    (op,) = rig.step().ops
    return op


def test_a_load_hands_its_lookups_locks_to_the_worker_that_adopts_them() -> None:
    rig, index, remote = _rig()
    _evicted(rig, index)
    assert rig.lookup("c", TOKENS) == 24
    op = _load(rig, "c")
    (held,) = index.taken
    assert op.held == held == HeldChunks(("lookup3.rank0",), 0, 3)  # the third lookup's
    assert index.handed == Counter([held])
    ((session, holder, chain, start, end),) = remote.adopted
    assert (session, holder, start, end) == ("c", "lookup3.rank0", 0, 3)
    assert len(chain) == 3
    assert rig.sched.take_load_errors() == {}
    rig.sched.finish(RequestId("c"))
    rig.step()
    assert index.settled()


def test_the_op_carries_the_chain_through_the_held_chunks_even_past_what_it_reads() -> None:
    rig, index, remote = _rig(slots=4)  # the pool keeps a's last chunk: the load reads it from there
    _evicted(rig, index)
    assert rig.lookup("c", TOKENS) == 24
    op = _load(rig, "c")
    assert len(op.remote) == 2  # chunks 0 and 1 come from the remote tier
    assert op.held == HeldChunks(("lookup3.rank0",), 0, 3)  # the lookup locked all three
    assert len(op.chain) == 3  # so the worker knows every key it must release
    assert remote.adopted[0][3:] == (0, 3)
    assert rig.sched.take_load_errors() == {}
    assert index.settled()


@pytest.mark.parametrize("end", ["finish", "abort", "preempt", "reset"])
def test_a_request_that_ends_or_starts_over_before_its_load_releases_the_locks(end: str) -> None:
    rig, index, _ = _rig()
    _evicted(rig, index)
    c = RequestId("c")
    assert rig.lookup(c, TOKENS) == 24
    assert sum(index.taken.values()) == 1
    if end == "reset":
        rig.sched.reset()
    elif end == "preempt":
        rig.sched.preempt(c)
    else:
        getattr(rig.sched, end)(c)
    assert index.settled()
    assert sum(index.released.values()) == 1
    if end == "preempt":  # looked up again, locked again, then loaded under the new locks
        assert rig.lookup(c, TOKENS) == 24
        assert _load(rig, "c").held is not None
    elif end == "reset":  # a new epoch: the store holds none of the new keys
        assert rig.lookup(c, TOKENS) == 0
    rig.sched.finish(c)
    rig.step()
    assert index.settled()


def test_a_load_that_reads_nothing_remote_or_nothing_at_all_releases_the_locks() -> None:
    rig, index, _ = _rig()
    _evicted(rig, index)
    # the engine's own prefix cache holds all the chunks: there is nothing to load
    hits = None
    for _ in range(100):
        if (hits := rig.sched.lookup(RequestId("c"), tokens=TOKENS, local_tokens=28)) is not None:
            break
    assert hits == 0
    assert index.settled()
    assert sum(index.released.values()) == 1


def test_a_load_whose_chunks_came_into_the_pool_meanwhile_releases_its_locks() -> None:
    rig, index, remote = _rig()
    _evicted(rig, index)
    assert rig.lookup("c", TOKENS) == 24
    assert rig.lookup("d", TOKENS) == 24  # both locked the same chunks on the remote tier
    assert _load(rig, "c").held is not None  # c fetches them into the pool
    rig.sched.start_load(RequestId("d"), range(30, 36))
    (op,) = rig.step().ops
    assert op.remote == ()  # d reads them from the pool
    assert op.held is None
    assert [a[0] for a in remote.adopted] == ["c"]
    assert sum(index.released.values()) == 1  # d's
    assert index.settled()


def test_a_miss_keeps_nothing() -> None:
    rig, index, _ = _rig()
    assert rig.lookup("c", TOKENS) == 0  # nothing in the store
    assert index.settled()
    assert sum(index.released.values()) == sum(index.taken.values()) == 1


def test_a_lock_too_old_to_hand_over_leaves_the_worker_to_lock_afresh() -> None:
    rig, index, remote = _rig()
    _evicted(rig, index)
    assert rig.lookup("c", TOKENS) == 24
    index.fresh = False
    op = _load(rig, "c")
    assert op.held is None
    assert remote.adopted == []
    assert rig.sched.take_load_errors() == {}
    assert index.settled()


def test_the_worker_leaves_locks_it_cannot_place_to_lapse(caplog: pytest.LogCaptureFixture) -> None:
    rig, _, remote = _rig()
    held = HeldChunks(("h",), 0, 3)
    op = BlockOp(1, Direction.LOAD, (), (), "r", held=held)  # no chain: the worker knows no key
    rig.worker.execute(StepPlan(ops=(op,)))
    assert remote.adopted == []
    assert "not taken over" in caplog.text


@pytest.mark.parametrize(
    ("holders", "start", "end"),
    [((), 0, 1), (("",), 0, 1), ("h", 0, 1), (("h",), -1, 1), (("h",), 2, 2), (("h",), True, 3)],
)
def test_held_chunks_refuse_what_names_no_lock(holders: object, start: object, end: object) -> None:
    with pytest.raises(InvalidSpecError, match=r"HeldChunks\.(holders|start|end)"):
        HeldChunks(holders, start, end)  # type: ignore[arg-type]  # the bad values under test
