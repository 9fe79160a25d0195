"""An LMCache server shared by engines of different tensor-parallel sizes (stepped by hand, real workers and
a real server): a chunk written at one TP size is served at another, every head of every layer the
writer's bytes, and the server holds one value per KV head of each chunk, whoever wrote it; with the
blocks moving straight between the engine and the server's slots (head blocks) and through a host pool
(a head's runs of a slot)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.config import load_config
from tests.cross_tp import KV_HEADS, cross_tp
from tests.hand_engine import CHUNK_TOKENS, CHUNKS
from tests.lmcache.conftest import ServerFactory


@pytest.mark.parametrize("local_size", [0, "16MiB"], ids=["blocks", "host-pool"])
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1), (4, 2), (2, 4)])
def test_a_chunk_written_at_one_tp_size_is_read_at_another(
    server_factory: ServerFactory, writer_tp: int, reader_tp: int, local_size: Any
) -> None:
    server = server_factory()  # of its own: every value in it is this test's
    server.start()
    backend = {"kind": "lmcache_mp", "url": server.url, "heartbeat_s": 0.5, "local_size": local_size}
    config = load_config({"chunk_tokens": CHUNK_TOKENS, "backend": backend})
    writer, reader = cross_tp(config, writer_tp, reader_tp, seed=500 + writer_tp * 10 + reader_tp)
    try:
        assert server.objects() == CHUNKS * KV_HEADS  # one value per head of each chunk
        stats = reader.sched.stats()
        assert stats.tier_found == (CHUNKS,)
        assert stats.assembled_chunks == CHUNKS
    finally:
        reader.close()
        writer.close()
