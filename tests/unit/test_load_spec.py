"""Load specs: start at the engine's first missing block, end at the hit or the prompt's last token."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcore.errors import InvalidSpecError
from kvcore.scheduling.load_spec import ChunkPiece, hit_tokens, plan_load


def test_load_starts_after_local_hit() -> None:
    # prompt 100 tokens, blocks of 16, engine holds 32, tier holds 64 -> load tokens [32, 64)
    spec = plan_load(prompt_tokens=100, local_tokens=32, external_tokens=64, block_tokens=16)
    assert spec is not None
    assert (spec.start, spec.stop, spec.first_block, spec.num_blocks) == (32, 64, 2, 2)


def test_never_the_whole_prompt() -> None:
    # tier holds all 64 tokens of a 64-token prompt -> all but the last token load; the last block is
    # copied whole and the engine computes its last position
    spec = plan_load(prompt_tokens=64, local_tokens=0, external_tokens=64, block_tokens=16)
    assert spec is not None
    assert (spec.stop, spec.num_tokens, spec.num_blocks) == (63, 63, 4)


def test_a_prompt_of_one_block_past_the_engine_hit_loads_its_first_tokens() -> None:
    # the engine holds 32 tokens of a 40-token prompt the tier holds whole: load [32, 39) into block 2
    spec = plan_load(prompt_tokens=40, local_tokens=32, external_tokens=48, block_tokens=16)
    assert spec is not None
    assert (spec.start, spec.stop, spec.first_block, spec.num_blocks) == (32, 39, 2, 1)
    assert spec.pieces(32) == (ChunkPiece(1, 0, 1),)


def test_a_partly_loaded_last_block_counts_its_tokens_only() -> None:
    spec = plan_load(prompt_tokens=50, local_tokens=0, external_tokens=64, block_tokens=16)
    assert spec is not None
    assert spec.num_blocks == 4
    assert spec.extra_cached_tokens() == 49
    assert [spec.tokens_in(n) for n in range(5)] == [0, 16, 32, 48, 49]
    assert spec.extra_cached_tokens({3}) == 48  # the partly loaded block failed
    assert spec.extra_cached_tokens({1}) == 16


def test_nothing_beyond_local_is_no_load() -> None:
    assert plan_load(prompt_tokens=100, local_tokens=64, external_tokens=64, block_tokens=16) is None
    assert plan_load(prompt_tokens=100, local_tokens=64, external_tokens=32, block_tokens=16) is None
    assert plan_load(prompt_tokens=100, local_tokens=0, external_tokens=0, block_tokens=16) is None


def test_pieces_start_mid_chunk() -> None:
    # chunks of 4 blocks; engine holds 6 blocks; load blocks [6, 12) -> chunk 1 blocks 2-3, chunk 2 blocks 0-3
    spec = plan_load(prompt_tokens=1000, local_tokens=96, external_tokens=192, block_tokens=16)
    assert spec is not None
    assert spec.pieces(64) == (ChunkPiece(1, 2, 2), ChunkPiece(2, 0, 4))


def test_extra_cached_tokens_counts_only_what_loaded() -> None:
    spec = plan_load(prompt_tokens=1000, local_tokens=32, external_tokens=160, block_tokens=16)
    assert spec is not None
    assert spec.extra_cached_tokens() == 128
    # block 5 failed -> blocks 2, 3, 4 count
    assert spec.extra_cached_tokens({5, 7}) == 48
    # a failure before the load's range does not count against it
    assert spec.extra_cached_tokens({0}) == 128


@pytest.mark.parametrize(
    ("prompt", "local", "external", "block"),
    [
        (100, 10, 64, 16),  # local hit not block-aligned
        (100, 128, 64, 16),  # local hit beyond the prompt
        (0, 0, 64, 16),  # empty prompt
        (100, 0, -1, 16),
        (100, 0, 64, 0),
    ],
)
def test_bad_input(prompt: int, local: int, external: int, block: int) -> None:
    with pytest.raises(InvalidSpecError):
        plan_load(prompt_tokens=prompt, local_tokens=local, external_tokens=external, block_tokens=block)


def test_hit_tokens() -> None:
    assert hit_tokens(2, (256, 256, 100)) == 512
    assert hit_tokens(3, (256, 256, 100)) == 612
    with pytest.raises(InvalidSpecError):
        hit_tokens(4, (256,))


@given(
    prompt=st.integers(1, 5000),
    local_blocks=st.integers(0, 400),
    external=st.integers(0, 6000),
    block=st.sampled_from([1, 16, 32, 128]),
)
def test_spec_invariants(prompt: int, local_blocks: int, external: int, block: int) -> None:
    local = min(local_blocks * block, prompt - prompt % block)
    spec = plan_load(prompt_tokens=prompt, local_tokens=local, external_tokens=external, block_tokens=block)
    if spec is None:
        assert min(external, prompt - 1) <= local
        return
    assert spec.start == local  # never rewrites a block the engine holds
    assert spec.start % block == 0
    assert spec.stop == min(prompt - 1, external)  # all the hit, and at least one token computed
    assert spec.num_tokens > 0
    # whole blocks cover the load, the last one no more than partly empty
    assert (spec.num_blocks - 1) * block < spec.num_tokens <= spec.num_blocks * block
    assert sum(p.num_blocks for p in spec.pieces(block * 4)) == spec.num_blocks
    assert spec.extra_cached_tokens() == spec.tokens_in(spec.num_blocks) == spec.num_tokens
