"""An MLA model (DeepSeek-V2 style, made locally) through kvcore on a real vLLM CPU engine.

vLLM's CPU MLA backend (``CPU_MLA``) keeps one latent of 576 values per token and layer, the same for
every head; kvcore describes it as ``LayoutKind.MLA``. On the CPU, vLLM turns its own prefix cache off
for MLA models, so there is no prefix hit of vLLM's to compare a reuse with, and every reuse here comes
from kvcore: its greedy tokens are compared with the first pass (a full recompute), and the loaded blocks
with the bytes kvcore saved. The model runs in float32: in bf16, a hit's context attention (the cached
latents up-projected) rounds differently from a full prefill's and moves near-tied greedy tokens of a
random model (seen at the 6th token of a 700-token prompt, loaded bytes equal).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore_cli.tiny_model import make_tiny_mla_model
from tests.integration.conftest import (
    VLLM_MARKS,
    generate,
    kvcore_transfer_config,
    prompt,
    start_engine,
    stop_engine,
)
from tests.integration.probes import external_hits, host_digests, loaded_digests

pytestmark = [*VLLM_MARKS, pytest.mark.slow]

BLOCK = 16  # the only block size vLLM's CPU MLA kernels take
CHUNK = 64
LATENT_BYTES = 576 * 4  # per token and layer, float32
PROMPTS = {"short": prompt(31, 300), "long": prompt(32, 700)}


def start_mla_engine(model: Path, kv_transfer_config: dict[str, Any], **engine_args: Any) -> Any:
    """A vLLM engine on the MLA model, in float32: bf16 rounding of MLA's context attention would move
    greedy tokens of a hit. ``engine_args`` go to vLLM (``tensor_parallel_size``)."""
    return start_engine(
        model,
        kv_transfer_config,
        kv_cache_memory_bytes=96 * BLOCK * LATENT_BYTES * 2,
        max_model_len=1024,
        dtype="float32",
        **engine_args,
    )


@pytest.fixture(scope="module")
def mla_engine(vllm_env: Path) -> Iterator[Any]:
    config = kvcore_transfer_config(backend={"kind": "cpu", "size": "64MiB"}, chunk_tokens=CHUNK)
    llm = start_mla_engine(make_tiny_mla_model(vllm_env / "tiny-mla"), config)
    yield llm
    stop_engine(llm)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_an_mla_prompt_is_reused_from_kvcore_with_the_tokens_of_a_recompute(
    mla_engine: Any, name: str
) -> None:
    # first pass: no hit, a full recompute; second pass: every whole block before the prompt's last token
    # comes from kvcore (vLLM's own prefix cache is off for MLA on CPU), the loaded blocks hold exactly
    # bytes kvcore saved, and the greedy tokens are the recompute's
    tokens = PROMPTS[name]
    before = external_hits(mla_engine)
    first = list(generate(mla_engine, tokens).outputs[0].token_ids)
    assert external_hits(mla_engine) == before
    (saved,) = mla_engine.collective_rpc(host_digests)
    second = list(generate(mla_engine, tokens).outputs[0].token_ids)
    hit = external_hits(mla_engine) - before
    assert hit == (len(tokens) - 1) // BLOCK * BLOCK
    ((digests, same),) = mla_engine.collective_rpc(loaded_digests)
    assert same
    assert len(digests) == hit // BLOCK
    assert set(digests) <= saved
    assert second == first
