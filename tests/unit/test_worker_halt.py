"""A worker's halt and resume (``BlockWorker.halt``/``resume``): while halted every op fails (a cache
miss); it copies again once the copy that made it halt has ended, over the same host slots, where its
mover can reopen (``SupportsReopen``); a worker whose remote tier moves blocks itself stays halted."""

from __future__ import annotations

from kvcore.plan import BlockOp, StepPlan
from kvcore.ports import Direction, SupportsReopen
from kvcore.remote import StoreRemote
from kvcore.testing.memory import InMemoryBlockMover, InMemoryChunkStore
from kvcore.worker import BlockWorker

BLOCK = 32


def _load(op_id: int, engine: int, host: int) -> StepPlan:
    return StepPlan((BlockOp(op_id, Direction.LOAD, (engine,), (host,), f"r{op_id}"),))


def _halted(worker: BlockWorker) -> bool:
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
        assert _halted(worker)
        worker.execute(_load(2, 6, 2))
        assert _failed(worker, 2) == (0,)  # halted: refused, a cache miss
        assert not worker.resume()  # the hung copy still runs
        assert _halted(worker)
    assert _failed(worker, 1) == ()  # the hung copy ended (and wrote its block)
    assert worker.resume()
    assert not _halted(worker)
    worker.execute(_load(3, 7, 2))
    assert _failed(worker, 3) == ()
    assert mover.read_engine_block(7) == b"\x02" * BLOCK
    worker.close()


def test_a_worker_without_a_mover_stays_halted() -> None:
    host = bytearray(8 * BLOCK)
    worker = BlockWorker(None, remote=StoreRemote(InMemoryChunkStore(host)))
    worker.halt()
    assert not worker.resume()
    assert _halted(worker)
    worker.close()
