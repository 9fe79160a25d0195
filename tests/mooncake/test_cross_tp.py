"""A Mooncake store shared by engines of different tensor-parallel sizes (stepped by hand, real workers and
a real master): a chunk written at one TP size is served at another, every head of every layer the
writer's bytes, and the store holds one value per KV head of each chunk, whoever wrote it."""

from __future__ import annotations

import pytest

from kvcore.config import load_config
from tests.cross_tp import KV_HEADS, cross_tp
from tests.hand_engine import CHUNK_TOKENS, CHUNKS
from tests.mooncake.conftest import MasterFactory, stored_keys


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1), (4, 2)])
def test_a_chunk_written_at_one_tp_size_is_read_at_another(
    master_factory: MasterFactory, writer_tp: int, reader_tp: int
) -> None:
    master = master_factory()  # of its own: every key in it is this test's
    config = load_config(
        {
            "chunk_tokens": CHUNK_TOKENS,
            "backend": {
                "kind": "mooncake_store",
                "master": master.address,
                "segment_size": "64MiB",
                "transfer_buffer_size": "16MiB",
            },
        }
    )
    writer, reader = cross_tp(config, writer_tp, reader_tp, seed=300 + writer_tp * 10 + reader_tp)
    try:
        keys = stored_keys(master)
        assert len(keys) == CHUNKS * KV_HEADS  # one value per head of each chunk
        assert {key.split("/")[2].split(".")[1] for key in keys} == {f"h{h}-{h + 1}" for h in range(KV_HEADS)}
        assert reader.sched.stats().tier_found == (CHUNKS,)
    finally:
        reader.close()
        writer.close()
