"""An MLA model's cache written at TP 2 and read at TP 1 (real vLLM CPU engines, DeepSeek-V2 style model
made locally, float32 as in ``test_vllm_mla.py``), through a disk tier both engines share.

MLA keeps one latent per token and layer, the same on every TP rank: rank 0 of the TP-2 engine writes
each chunk (its replica does not), and the TP-1 engine reads it. vLLM turns its own prefix cache off for
MLA on the CPU, so the reference is the reader's own recompute of the prompt (under a cache salt: kvcore
finds nothing for it); across TP sizes only its first token is compared (the latents another TP size
computed may round differently), and the loaded blocks byte for byte with the writer's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore_cli.tiny_model import make_tiny_mla_model
from tests.integration.conftest import VLLM_MARKS, kvcore_transfer_config, prompt, stop_engine
from tests.integration.cross_tp import salted_generate
from tests.integration.probes import engine_digests, external_hits, loaded_digests
from tests.integration.test_vllm_mla import BLOCK, CHUNK, start_mla_engine
from tests.integration.tp2 import engine_env

pytestmark = [*VLLM_MARKS, pytest.mark.slow]

TOKENS = prompt(41, 700)


@pytest.fixture(scope="module")
def engines(vllm_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Any]]:
    folder = tmp_path_factory.mktemp("shared-disk")
    backend = {"kind": "disk", "path": str(folder), "size": "256MiB", "local_size": "32MiB"}
    config = kvcore_transfer_config(backend=backend, chunk_tokens=CHUNK)
    model = make_tiny_mla_model(vllm_env / "tiny-mla")
    started: dict[int, Any] = {}
    try:
        for tp in (2, 1):
            with engine_env(tp):
                started[tp] = start_mla_engine(model, config, tensor_parallel_size=tp)
        yield started
    finally:
        for llm in started.values():
            stop_engine(llm)


def test_an_mla_prompt_computed_at_tp_2_is_served_at_tp_1(engines: dict[int, Any]) -> None:
    writer, reader = engines[2], engines[1]
    salted_generate(writer, TOKENS)
    written = writer.collective_rpc(engine_digests)
    assert written[0] == written[1], "the TP-2 ranks hold different latents"
    before = external_hits(reader)
    served = salted_generate(reader, TOKENS)
    hit = external_hits(reader) - before
    assert hit == (len(TOKENS) - 1) // BLOCK * BLOCK  # every whole block before the last token
    ((digests, same),) = reader.collective_rpc(loaded_digests)
    assert same
    assert len(digests) == hit // BLOCK
    assert set(digests) <= written[0]  # the latents TP 2 computed, byte for byte
    own = salted_generate(reader, TOKENS, salt="computed here")  # no hit: the reader computes it all
    assert list(served.outputs[0].token_ids)[:1] == list(own.outputs[0].token_ids)[:1]
