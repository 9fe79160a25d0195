"""An out-of-tree backend serving a real vLLM engine, installed as its author would install it.

The example distribution of docs/writing-a-backend.md (``docs/examples/dirstore``: chunks as files in a
directory) is installed into a folder of its own — its package and a ``.dist-info`` carrying the entry
points of its ``pyproject.toml``, as ``pip install`` lays them out — that goes on the server's
``PYTHONPATH``; nothing of kvcore changes. vLLM's server is started with ``"kind": "dirstore"`` and a host
pool of four chunks: once other prompts have turned over both vLLM's cache and the pool, a prompt's
prefix can only come back from the files, and does, with the tokens of the first run; with its files
deleted, it does not.
"""

from __future__ import annotations

import shutil
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import (
    BLOCK,
    ENGINE_BLOCKS,
    MAX_MODEL_LEN,
    VLLM_MARKS,
    kvcore_transfer_config,
    prompt,
)
from tests.integration.served import KV_BYTES_PER_TOKEN, ServedEngine, serve

pytestmark = VLLM_MARKS

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "dirstore"
PROMPT = prompt(300, 4 * BLOCK + 40)  # 4 full chunks and a tail


def install(site: Path) -> None:
    """What ``pip install docs/examples/dirstore`` leaves in ``site``: the package and its metadata."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    shutil.copytree(EXAMPLE / "kvcore_dirstore", site / "kvcore_dirstore")
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    groups = project["entry-points"]
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items())
            for group, entries in groups.items()
        )
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    install(root)
    return root


POOL_CHUNKS = 4  # the host pool: a chunk is 128 tokens x 512 bytes


def _chunk_files(store: Path) -> set[Path]:
    return {p for p in store.iterdir() if not p.name.startswith(".")}  # a temporary starts with "."


def _push_out(server: ServedEngine, seed: int) -> None:
    """Three prompts of 12 blocks each through vLLM's 24-block cache and the 4-chunk pool; returns once
    their saves have ended (a 4-chunk pool whose every slot is being stored has none to fetch into)."""
    for i in range(3):
        server.complete(prompt(seed + i, 1500), max_tokens=1)
    # saves are reported with the engine's steps, and an idle server runs none: short requests (less
    # than a block: nothing to save) step it until the pool stores nothing
    for i in range(20):
        server.complete(prompt(seed + 100 + i, 16), max_tokens=1)
        if not server.metrics().get("vllm:kvcore_pool_storing", 0.0):
            return
        time.sleep(0.1)
    raise AssertionError("the pool's saves never ended")


def _extra(answer: dict[str, Any]) -> int:
    tokens: int = answer["kv_transfer_params"]["num_extra_cached_tokens"]
    return tokens


def test_an_installed_backend_serves_vllm_from_its_files(
    vllm_env: Path, tiny_model: Path, site: Path, tmp_path: Path
) -> None:
    store = tmp_path / "chunks"
    backend = {"kind": "dirstore", "path": str(store), "local_size": POOL_CHUNKS * BLOCK * KV_BYTES_PER_TOKEN}
    config = kvcore_transfer_config(backend=backend)
    asked = {"num_extra_cached_tokens": True}
    with serve(
        vllm_env,
        tiny_model,
        tmp_path / "server.log",
        config,
        kv_cache_tokens=ENGINE_BLOCKS * BLOCK,
        max_model_len=MAX_MODEL_LEN,
        python_path=[site],
    ) as server:
        first = server.complete(PROMPT, kv_transfer_params=asked)
        files = _chunk_files(store)
        assert len(files) == 4  # one file per full chunk (one shard at TP 1), no temporary left
        assert all(f.stat().st_size == BLOCK * KV_BYTES_PER_TOKEN for f in files)
        _push_out(server, 200)
        again = server.complete(PROMPT, kv_transfer_params=asked)
        for file in files:
            file.unlink()
        _push_out(server, 400)
        gone = server.complete(PROMPT, kv_transfer_params=asked)
    assert [_extra(a) for a in (first, again, gone)] == [0, 4 * BLOCK, 0]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
    tokens = [a["choices"][0]["token_ids"] for a in (first, again, gone)]
    assert tokens[1] == tokens[0] == tokens[2]
