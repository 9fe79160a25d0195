"""A worker's halt and resume (``BlockWorker.halt``/``resume``): while halted every op fails (a cache
miss); it copies again once the copy that made it halt has ended, over the same host slots, where its
mover can reopen (``SupportsReopen``); a worker whose remote tier moves blocks itself stays halted."""

from __future__ import annotations

from kvcore.execution.remote import StoreRemote
from kvcore.execution.worker import BlockWorker
from kvcore.ids import ChunkKey
from kvcore.model.step import BlockOp, RemoteChunk, StepPlan
from kvcore.ports import Direction, SupportsReopen
from kvcore.testing.memory import InMemoryBlockMover, InMemoryChunkStore
from tests.unit.test_scheduler_no_pool import BlockMovingTier

BLOCK = 32


def _load(op_id: int, engine: int, host: int) -> StepPlan:
    return StepPlan((BlockOp(op_id, Direction.LOAD, (engine,), (host,), f"r{op_id}"),))


def halted_now(worker: BlockWorker) -> bool:
    """``worker.halted``, read afresh (mypy would keep a property narrowed across the calls between)."""
    return worker.halted


def _failed(worker: BlockWorker, op_id: int) -> tuple[int, ...]:
    (report,) = [r for r in worker.wait([op_id], 5) if r.op_id == op_id]
    return report.failed


def test_a_halted_worker_fails_every_op_and_resumes_once_its_copy_ended() -> None:
    mover = InMemoryBlockMover(num_engine_blocks=8, num_host_blocks=8, layer_block_bytes=BLOCK)
    assert isinstance(mover, SupportsReopen)
    worker = BlockWorker(mover)
    mover.write_host_block(2, b"\x02" * BLOCK)
    assert worker.resume()  # a worker that is not halted copies
    with mover.stall():
        worker.execute(_load(1, 5, 2))  # hangs in the mover
        worker.halt()
        assert halted_now(worker)
        worker.execute(_load(2, 6, 2))
        assert _failed(worker, 2) == (0,)  # halted: refused, a cache miss
        assert not worker.resume()  # the hung copy still runs
        assert halted_now(worker)
    assert _failed(worker, 1) == ()  # the hung copy ended (and wrote its block)
    assert worker.resume()
    assert not halted_now(worker)
    worker.execute(_load(3, 7, 2))
    assert _failed(worker, 3) == ()
    assert mover.read_engine_block(7) == b"\x02" * BLOCK
    worker.close()


def test_a_worker_without_a_mover_stays_halted() -> None:
    host = bytearray(8 * BLOCK)
    worker = BlockWorker(None, remote=StoreRemote(InMemoryChunkStore(host)))
    worker.halt()
    assert not worker.resume()
    assert halted_now(worker)
    worker.close()


class ReopenFails(InMemoryBlockMover):
    """A mover whose reopen fails (a device that cannot start a copy stream)."""

    def reopen(self) -> bool:
        raise RuntimeError("no stream for you")


def test_a_mover_that_fails_to_reopen_leaves_the_worker_halted_without_raising() -> None:
    worker = BlockWorker(ReopenFails(num_engine_blocks=8, num_host_blocks=8, layer_block_bytes=BLOCK))
    worker.halt()
    assert not worker.resume()
    assert halted_now(worker)


def test_a_closed_worker_does_not_resume() -> None:
    worker = BlockWorker(InMemoryBlockMover(num_engine_blocks=8, num_host_blocks=8, layer_block_bytes=BLOCK))
    worker.halt()
    worker.close()
    assert not worker.resume()


def test_a_load_the_remote_tier_moves_itself_holds_the_resume() -> None:
    engine = InMemoryBlockMover(num_engine_blocks=8, num_host_blocks=8, layer_block_bytes=BLOCK)
    tier = BlockMovingTier({ChunkKey("k"): b"\x07" * 2 * BLOCK}, engine)
    tier.hold = True
    worker = BlockWorker(engine, 0, tier, 2 * BLOCK, slot_blocks=2)
    chunk = RemoteChunk(slot=None, keys=(ChunkKey("k"),), first=0, count=2)
    op = BlockOp(1, Direction.LOAD, (5, 6), (), "r", (chunk,), 0, ((ChunkKey("k"),),))
    worker.execute(StepPlan((op,)))
    worker.halt()  # closes the mover only: the tier's own copy into blocks 5 and 6 is still in flight
    assert not worker.resume()
    tier.release()
    assert [r.op_id for r in worker.wait([1], 5)] == [1]
    assert worker.resume()
    worker.close()
