"""docs/engine-api.md's example engine on a real Mooncake store: the same composition call as on the CPU
tier, the backend chosen by the config alone."""

from __future__ import annotations

from tests.engine_example import run_toy_engine
from tests.mooncake.conftest import Master


def test_toy_engine_example_runs_on_a_mooncake_store(master: Master) -> None:
    backend = {
        "kind": "mooncake_store",
        "master": master.address,
        "local_size": "64MiB",
        "segment_size": "64MiB",
        "transfer_buffer_size": "16MiB",
    }
    out = run_toy_engine(backend)
    assert "mooncake_store: loaded 288 of 300 tokens from kvcore; bytes identical: True" in out
