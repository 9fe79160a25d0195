"""An LMCache server shared by real vLLM engines of different tensor-parallel sizes (CPU build, a tiny model
with four KV heads, a server of this module's own): a prompt computed at TP 1 is served at TP 2 from the
server, and one computed at TP 2 at TP 1, each head of each layer the writer's bytes
(``tests.integration.cross_tp``). Blocks move straight between each rank's engine blocks and the
server's slots (no ``local_size``): each rank copies its heads' head blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import VLLM_MARKS, tiny_model, vllm_env
from tests.integration.cross_tp import both_engines, check_read, read_across
from tests.integration.tp2 import CHUNK, PATIENCE_S
from tests.lmcache.conftest import Launcher, LMCacheServer

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = VLLM_MARKS


@pytest.fixture(scope="module")
def engines(
    vllm_env: Path, lmcache_launcher: Launcher, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[int, Any]]:
    server = LMCacheServer(lmcache_launcher, tmp_path_factory.mktemp("lmcache-cross-tp"), CHUNK)
    server.start()
    try:
        backend = {"kind": "lmcache_mp", "url": server.url, "request_timeout_s": PATIENCE_S}
        with both_engines(vllm_env, backend) as started:
            yield started
    finally:
        server.kill()


@pytest.mark.parametrize(("writer", "reader"), [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_a_prompt_computed_at_one_tp_size_is_served_at_the_other(
    engines: dict[int, Any], writer: int, reader: int
) -> None:
    check_read(read_across(engines, writer, reader, seed=9600 + writer))
