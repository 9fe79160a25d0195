"""The ops in flight (``kvcore.scheduling.ledger``): an op is done once every rank reported it, and a remote
tier holds one of its chunks only where every rank that writes a shard of it stored its shard there."""

from __future__ import annotations

from kvcore.ids import ChunkKey, RequestId
from kvcore.model.step import BlockOp, OpReport, RemoteChunk
from kvcore.ports import Direction
from kvcore.scheduling.ledger import OpLedger

A, B = ChunkKey("pool/a"), ChunkKey("pool/b")


def _save(ledger: OpLedger) -> BlockOp:
    """A save of two chunks of two blocks each; chunk A has a shard per rank, chunk B one shard that rank
    0 writes (rank 1 holds a replica)."""
    remote = (
        RemoteChunk(0, (ChunkKey("a/0"), ChunkKey("a/1")), first=0, count=2),
        RemoteChunk(1, (ChunkKey("b/0"), None), first=2, count=2),
    )
    op = BlockOp(ledger.next_id(), Direction.SAVE, (4, 5, 6, 7), (0, 1, 2, 3), "r", remote)
    ledger.add(RequestId("r"), op, (A, B), (2, 2), 0)
    return op


def test_a_chunk_is_held_by_the_tiers_every_writing_rank_stored_its_shard_in() -> None:
    ledger = OpLedger(2)
    op = _save(ledger)
    assert ledger.report(OpReport(op.op_id, 0, placed=((0, 1), (1,)))) is None  # rank 1 not yet
    entry = ledger.report(OpReport(op.op_id, 1, placed=((1,), ())))
    assert entry is not None
    assert entry.remote_keys() == (A, B)
    # A: rank 0 in tiers 0 and 1, rank 1 in tier 1 only; B: its one writer, rank 0, in tier 1
    assert entry.tiers_holding() == {1: [A, B]}


def test_a_rank_that_stored_nothing_leaves_its_chunks_in_no_tier() -> None:
    ledger = OpLedger(2)
    op = _save(ledger)
    ledger.report(OpReport(op.op_id, 0, placed=((0,), (0,))))
    entry = ledger.report(OpReport(op.op_id, 1, failed=(0, 1), error="copy failed"))
    assert entry is not None
    assert entry.tiers_holding() == {0: [B]}  # A's second shard is nowhere
    assert entry.failed_chunks() == (A,)
