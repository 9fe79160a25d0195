"""An out-of-tree backend serving a real vLLM engine, installed as its author would install it.

The example distribution of docs/writing-a-backend.md (``docs/examples/dirstore``: chunks as files in a
directory) is installed into a folder of its own — its package and a ``.dist-info`` carrying the entry
points of its ``pyproject.toml``, as ``pip install`` lays them out — that goes on the server's
``PYTHONPATH``; nothing of kvcore changes. vLLM's server is started with ``"kind": "dirstore"`` and
serves a prompt, is stopped, and a second server on the same directory serves the prompt's prefix from
the files alone (its own cache and kvcore's pool start empty), with the tokens of the first run.
"""

from __future__ import annotations

import shutil
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
from tests.integration.served import serve

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


def _complete(vllm_env: Path, model: Path, site: Path, store: Path, log: Path) -> dict[str, Any]:
    """``PROMPT`` completed by a fresh server with the dirstore backend on ``store``."""
    config = kvcore_transfer_config(backend={"kind": "dirstore", "path": str(store), "local_size": "64MiB"})
    tokens = ENGINE_BLOCKS * BLOCK
    with serve(
        vllm_env, model, log, config, kv_cache_tokens=tokens, max_model_len=MAX_MODEL_LEN, python_path=[site]
    ) as server:
        return server.complete(PROMPT, kv_transfer_params={"num_extra_cached_tokens": True})


def test_an_installed_backend_serves_vllm_across_a_restart(
    vllm_env: Path, tiny_model: Path, site: Path, tmp_path: Path
) -> None:
    store = tmp_path / "chunks"
    first = _complete(vllm_env, tiny_model, site, store, tmp_path / "first.log")
    files = sorted(p for p in store.iterdir() if not p.name.startswith("."))
    assert len(files) == 4  # one file per full chunk (one shard at TP 1), no temporary left
    assert all(f.stat().st_size == BLOCK * 512 for f in files)  # a chunk: 128 tokens x 512 bytes
    again = _complete(vllm_env, tiny_model, site, store, tmp_path / "again.log")
    assert first["kv_transfer_params"] == {"num_extra_cached_tokens": 0}
    assert again["kv_transfer_params"] == {"num_extra_cached_tokens": 4 * BLOCK}
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
