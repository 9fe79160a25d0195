"""``RemoteTier.close`` of both remote tiers (``kvcore.execution.remote``): whatever the tier beneath raises
once closed, the remote tier refuses with ``UsageError``, and reports the jobs submitted before."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcore.errors import UsageError
from kvcore.execution.remote import ManagedRemote, StoreRemote
from kvcore.ids import ChunkKey
from kvcore.ports import BlockItem, StoreItem
from kvcore.testing.memory import (
    InMemoryBlockMover,
    InMemoryBlockTransferTier,
    InMemoryChunkStore,
    InMemoryManagedTier,
)
from kvcore.testing.support import check_close

KEY = ChunkKey("k")
ITEMS = [StoreItem(KEY, 0, 8)]

Remote = StoreRemote | ManagedRemote


def _engine() -> InMemoryBlockMover:
    return InMemoryBlockMover(num_engine_blocks=4, num_host_blocks=1, layer_block_bytes=8)


TIERS: dict[str, Callable[[bytearray], Remote]] = {
    "store": lambda host: StoreRemote(InMemoryChunkStore(host)),
    "managed": lambda host: ManagedRemote(InMemoryManagedTier(host)),
    "blocks": lambda host: ManagedRemote(
        InMemoryBlockTransferTier(host, engine=_engine(), blocks_per_chunk=1)
    ),
}


@pytest.mark.parametrize("kind", list(TIERS))
def test_close_refuses_submits_with_usage_error_and_reports_earlier_jobs(kind: str) -> None:
    host = bytearray(b"12345678")
    remote = TIERS[kind](host)
    assert check_close(remote, remote.close, lambda: remote.submit_publish("s", ITEMS), UsageError).ok
    with pytest.raises(UsageError, match=r"^submit_fetch: the remote tier \(\w+\) is closed"):
        remote.submit_fetch("s", ITEMS)
    remote.end_session("s")


def test_a_closed_managed_remote_refuses_block_moves_before_asking_the_tier() -> None:
    remote = ManagedRemote(InMemoryBlockTransferTier(bytearray(8), engine=_engine(), blocks_per_chunk=1))
    remote.close()
    for submit in (remote.submit_fetch_blocks, remote.submit_publish_blocks):
        with pytest.raises(UsageError, match="closed"):
            submit("s", [BlockItem(KEY, (0,))])


def test_a_managed_remote_moves_blocks_through_a_block_transfer_tier() -> None:
    engine = _engine()
    engine.write_engine_block(0, b"abcdefgh")
    blocks = ManagedRemote(InMemoryBlockTransferTier(bytearray(8), engine=engine, blocks_per_chunk=1))
    job = blocks.submit_publish_blocks("s", [BlockItem(KEY, (0,))])
    assert blocks.wait([job], 5.0)[0].ok
    job = blocks.submit_fetch_blocks("s", [BlockItem(KEY, (3,))])
    assert blocks.wait([job], 5.0)[0].ok
    assert engine.read_engine_block(3) == b"abcdefgh"
