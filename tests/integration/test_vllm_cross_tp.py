"""kvcore's disk tier shared by real vLLM engines of different tensor-parallel sizes (CPU build, a tiny
model with four KV heads): a prompt computed at TP 1 is served at TP 2 from the disk, and one computed at
TP 2 is served at TP 1, each head of each layer the writer's bytes (``tests.integration.cross_tp``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import VLLM_MARKS
from tests.integration.cross_tp import CrossRead, both_engines, check_read, read_across

pytestmark = VLLM_MARKS


@pytest.fixture(scope="module")
def engines(vllm_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Any]]:
    folder = tmp_path_factory.mktemp("shared-disk")
    with both_engines(
        vllm_env, {"kind": "disk", "path": str(folder), "size": "256MiB", "local_size": "32MiB"}
    ) as e:
        yield e


@pytest.mark.parametrize(("writer", "reader"), [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_a_prompt_computed_at_one_tp_size_is_served_at_the_other(
    engines: dict[int, Any], writer: int, reader: int
) -> None:
    read: CrossRead = read_across(engines, writer, reader, seed=9300 + writer)
    check_read(read)
