"""docs/engine-api.md's example engine on a real LMCache server, with no host pool of its own: every
chunk, and the prompt's tail (its whole blocks after the last whole chunk), goes to the server and comes
back from it, through the same composition call as the CPU tier."""

from __future__ import annotations

from tests.engine_example import run_toy_engine
from tests.lmcache.conftest import LMCacheServer


def test_toy_engine_example_runs_on_an_lmcache_server(lmcache_server: LMCacheServer) -> None:
    out = run_toy_engine({"kind": "lmcache_mp", "url": lmcache_server.url})
    assert "lmcache_mp: loaded 288 of 300 tokens from kvcore; bytes identical: True" in out
