"""Chained chunk hashing: determinism, prefix structure, what each input changes, regrouping."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.errors import ConfigError, InvalidSpecError
from kvcore.keying.hashing import (
    NO_EXTRA,
    ChunkHasher,
    ExtraKeys,
    HashAlgorithm,
    MMSpan,
    PartialChunkPolicy,
    regroup_block_hashes,
)

REPO = Path(__file__).resolve().parents[2]
C = 4  # small chunks keep the properties cheap
SEED = b"test-seed"

tokens_st = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40)
algorithms = st.sampled_from(list(HashAlgorithm))


def hasher(
    algorithm: HashAlgorithm = HashAlgorithm.SHA256,
    seed: bytes = SEED,
    chunk_tokens: int = C,
    partial: PartialChunkPolicy = PartialChunkPolicy.DROP,
) -> ChunkHasher:
    return ChunkHasher(algorithm, seed, chunk_tokens, partial)


def first_difference(a: tuple[bytes, ...], b: tuple[bytes, ...]) -> int:
    """Index of the first differing hash; asserts every later one differs too (the chain)."""
    assert len(a) == len(b)
    diff = [x != y for x, y in zip(a, b, strict=True)]
    first = diff.index(True) if True in diff else len(diff)
    assert all(diff[first:]), "a changed chunk must change every later chunk"
    return first


def vectors() -> str:
    """Chunk hashes of a fixed input under every algorithm, as text."""
    extra = ExtraKeys("salt", "lora", (MMSpan("img", 20, 30),))
    lines = []
    for algorithm in HashAlgorithm:
        h = ChunkHasher(algorithm, b"seed", 16, PartialChunkPolicy.KEEP)
        lines.append(" ".join([h.seed_digest(), *(x.hex() for x in h.hash_tokens(list(range(100)), extra))]))
    return "\n".join(lines)


def test_hashes_are_equal_across_processes_with_different_hash_seeds() -> None:
    # two interpreters with PYTHONHASHSEED 0 and 4242 -> the same chunk hashes, and the same as here
    code = "from tests.unit.test_hashing import vectors; print(vectors(), end='')"
    outputs = []
    for hash_seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=60
        )
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1] == vectors()


def test_hash_format_is_pinned() -> None:
    # a change here changes every key already stored in a shared tier: bump the domain tag knowingly
    root = hashlib.sha256(b"kvcore.chunk-hash.v1" + struct.pack("<I", 6) + b"sha256" + SEED).digest()
    first = hashlib.sha256(root + struct.pack("<4I", 1, 2, 3, 4) + struct.pack("<I", 4)).digest()
    assert hasher().hash_tokens([1, 2, 3, 4]) == (first,)
    assert first.hex() == "97a68330042bbc4f7e1d3a774b7d2278af143238dec962646c54889714db9414"
    blake = hasher(HashAlgorithm.BLAKE2B).hash_tokens([1, 2, 3, 4])
    assert blake[0].hex() == "b17227dccb57f6cffb10fa37c0f048ea5964c700fb895844f4f143c23ee4449c"


@given(tokens=tokens_st, cut=st.integers(0, 40), algorithm=algorithms)
@settings(max_examples=60)
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(
    tokens: list[int], cut: int, algorithm: HashAlgorithm
) -> None:
    h = hasher(algorithm)
    whole = h.hash_tokens(tokens)
    head = h.hash_tokens(tokens[:cut])
    assert whole[: len(head)] == head
    assert len(whole) == len(tokens) // C


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=C, max_size=40),
    partial=st.sampled_from(list(PartialChunkPolicy)),
    data=st.data(),
)
@settings(max_examples=60)
def test_continuing_a_chain_equals_hashing_at_once(
    tokens: list[int], partial: PartialChunkPolicy, data: st.DataObject
) -> None:
    # hash [0, cut) then [cut, n) with parent = last hash and start = cut -> same as hashing [0, n)
    h = hasher(partial=partial)
    cut = C * data.draw(st.integers(1, len(tokens) // C))
    extra = ExtraKeys("salt", "lora", (MMSpan("a", 2, 9), MMSpan("b", 13, 1)))
    head = h.hash_tokens(tokens[:cut], extra)
    tail = h.hash_tokens(tokens[cut:], extra, parent=head[-1], start=cut)
    assert head + tail == h.hash_tokens(tokens, extra)


@given(tokens=st.lists(st.integers(0, 1000), min_size=1, max_size=40), data=st.data())
@settings(max_examples=80)
def test_changing_a_token_changes_its_chunk_and_every_later_one(
    tokens: list[int], data: st.DataObject
) -> None:
    # tokens[p] changes -> hashes [0, p // C) equal, [p // C, ...) all differ
    h = hasher(partial=PartialChunkPolicy.KEEP)
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = [*tokens]
    changed[position] += 1
    assert first_difference(h.hash_tokens(tokens), h.hash_tokens(changed)) == position // C


@given(tokens=st.lists(st.integers(0, 1000), min_size=C, max_size=40))
@settings(max_examples=30)
def test_seed_algorithm_salt_and_lora_change_every_chunk(tokens: list[int]) -> None:
    base = hasher().hash_tokens(tokens)
    variants = [
        hasher(seed=b"other").hash_tokens(tokens),
        hasher(HashAlgorithm.BLAKE2B).hash_tokens(tokens),
        hasher().hash_tokens(tokens, ExtraKeys(cache_salt="s1")),
        hasher().hash_tokens(tokens, ExtraKeys(lora_id="adapter")),
    ]
    for variant in variants:
        assert first_difference(base, variant) == 0
    # a different salt or LoRA, not only present vs absent
    assert (
        first_difference(
            hasher().hash_tokens(tokens, ExtraKeys(cache_salt="s1")),
            hasher().hash_tokens(tokens, ExtraKeys(cache_salt="s2")),
        )
        == 0
    )
    assert (
        first_difference(
            hasher().hash_tokens(tokens, ExtraKeys(lora_id="a")),
            hasher().hash_tokens(tokens, ExtraKeys(lora_id="b")),
        )
        == 0
    )


def test_salt_goes_into_the_first_chunk_only() -> None:
    # a continued chain (start > 0) adds no salt: the salted first chunk already covers it
    h = hasher()
    tokens = list(range(12))
    salted = h.hash_tokens(tokens, ExtraKeys(cache_salt="s"))
    plain_tail = h.hash_tokens(tokens[C:], NO_EXTRA, parent=salted[0], start=C)
    assert salted[1:] == plain_tail


@pytest.mark.parametrize(
    ("span", "other", "first_changed"),
    [
        # image on tokens [9, 12) with C=4 -> chunks 2.. change, chunks 0, 1 do not
        (MMSpan("img", 9, 3), None, 2),
        # image across chunks 1 and 2 vs a different image there
        (MMSpan("img", 6, 4), MMSpan("other", 6, 4), 1),
        # same image moved from [13, 14) to [14, 15): chunk 3 changes
        (MMSpan("img", 13, 1), MMSpan("img", 14, 1), 3),
        # same image, longer: its span is keyed, so chunk 3 changes too, not only the new chunk 4
        (MMSpan("img", 13, 2), MMSpan("img", 13, 4), 3),
        # image on the partial chunk [20, 22) only
        (MMSpan("img", 20, 2), None, 5),
    ],
)
def test_multimodal_spans_change_the_chunks_they_overlap_and_later(
    span: MMSpan, other: MMSpan | None, first_changed: int
) -> None:
    h = hasher(partial=PartialChunkPolicy.KEEP)
    tokens = list(range(22))
    before = h.hash_tokens(tokens, ExtraKeys(mm=() if other is None else (other,)))
    after = h.hash_tokens(tokens, ExtraKeys(mm=(span,)))
    assert first_difference(before, after) == first_changed


def test_multimodal_span_past_the_hashed_tokens_changes_nothing() -> None:
    # 10 tokens, C=4, DROP -> chunks cover [0, 8): an image on [8, 10) is in no hashed chunk
    h = hasher()
    tokens = list(range(10))
    assert h.hash_tokens(tokens, ExtraKeys(mm=(MMSpan("img", 8, 2),))) == h.hash_tokens(tokens)


def test_extra_keys_are_canonical() -> None:
    # empty salt/LoRA is no salt/LoRA (as in vLLM); span order does not matter
    a, b = MMSpan("a", 0, 2), MMSpan("b", 5, 1)
    assert ExtraKeys(cache_salt="", lora_id="") == NO_EXTRA
    assert ExtraKeys(mm=(b, a)) == ExtraKeys(mm=(a, b))
    h = hasher()
    assert h.hash_tokens(list(range(8)), ExtraKeys(mm=(b, a))) == h.hash_tokens(
        list(range(8)), ExtraKeys(mm=(a, b))
    )


@pytest.mark.parametrize(
    ("num_tokens", "drop", "keep"),
    [(0, (), ()), (3, (), (3,)), (8, (4, 4), (4, 4)), (10, (4, 4), (4, 4, 2))],
)
def test_partial_policy_counts(num_tokens: int, drop: tuple[int, ...], keep: tuple[int, ...]) -> None:
    assert hasher().chunk_token_counts(num_tokens) == drop
    assert hasher(partial=PartialChunkPolicy.KEEP).chunk_token_counts(num_tokens) == keep


@given(tokens=tokens_st)
@settings(max_examples=40)
def test_keep_adds_the_partial_chunk_and_leaves_full_chunks_alone(tokens: list[int]) -> None:
    drop = hasher().hash_tokens(tokens)
    keep = hasher(partial=PartialChunkPolicy.KEEP).hash_tokens(tokens)
    assert keep[: len(drop)] == drop
    assert len(keep) == len(drop) + (1 if len(tokens) % C else 0)


def test_partial_chunk_is_keyed_apart_from_full_chunks() -> None:
    # [0..6) with KEEP -> a partial hash over 2 tokens, unlike the full chunk over [4..8)
    keep = hasher(partial=PartialChunkPolicy.KEEP)
    assert keep.hash_tokens(list(range(6)))[1] != keep.hash_tokens(list(range(8)))[1]
    # token bytes cannot pose as extra keys: the token count is hashed with them
    lora = ExtraKeys(lora_id="abc")
    record = b"L" + struct.pack("<I", 3) + b"abc"  # the LoRA record's encoding
    posing = list(array("I", struct.pack("<I", 7) + record))
    assert keep.hash_tokens([7], lora) != keep.hash_tokens(posing)


def test_token_sequences_of_any_kind_hash_alike() -> None:
    h = hasher()
    tokens = list(range(8))
    expected = h.hash_tokens(tokens)
    assert h.hash_tokens(tuple(tokens)) == expected
    assert h.hash_tokens(array("I", tokens)) == expected
    assert h.hash_tokens(range(8)) == expected


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", None])
def test_bad_token_is_refused(bad: object) -> None:
    with pytest.raises(InvalidSpecError, match="token"):
        hasher().hash_tokens([1, 2, bad, 4])  # type: ignore[list-item]  # a bad token on purpose


def test_bad_hasher_arguments_are_refused() -> None:
    h = hasher()
    with pytest.raises(ValueError, match="chunk_tokens"):
        hasher(chunk_tokens=0)
    with pytest.raises(InvalidSpecError, match="seed"):
        ChunkHasher(HashAlgorithm.SHA256, "seed")  # type: ignore[arg-type]  # str is not bytes
    with pytest.raises(InvalidSpecError, match="start"):
        h.hash_tokens([1] * 8, parent=bytes(32), start=3)
    with pytest.raises(InvalidSpecError, match="parent"):
        h.hash_tokens([1] * 8, start=4)
    with pytest.raises(InvalidSpecError, match="parent"):
        h.hash_tokens([1] * 8, parent=bytes(32))
    with pytest.raises(InvalidSpecError, match="32-byte"):
        h.hash_tokens([1] * 8, parent=b"short", start=4)
    with pytest.raises(InvalidSpecError, match="num_tokens"):
        h.chunk_token_counts(-1)
    with pytest.raises(ValueError, match="length"):
        MMSpan("img", 0, 0)
    with pytest.raises(InvalidSpecError, match="cache_salt"):
        ExtraKeys(cache_salt="\ud800")


def block_chain(tokens: list[int], block: int) -> tuple[bytes, ...]:
    """An engine's per-block chain (as vLLM's request.block_hashes), full blocks only."""
    return hasher(chunk_tokens=block).hash_tokens(tokens)


@given(
    tokens=st.lists(st.integers(0, 50), max_size=80),
    block=st.sampled_from([1, 2, 4]),
    per_chunk=st.integers(1, 5),
    partial=st.sampled_from(list(PartialChunkPolicy)),
)
@settings(max_examples=80)
def test_regrouping_picks_the_block_hash_that_ends_each_chunk(
    tokens: list[int], block: int, per_chunk: int, partial: PartialChunkPolicy
) -> None:
    # chunk j = blocks [j*k, (j+1)*k) -> its hash is the chain's hash of the prefix ending at that chunk
    chunk = block * per_chunk
    blocks = block_chain(tokens, block)
    chunks = regroup_block_hashes(blocks, block, chunk, partial)
    num_blocks = len(tokens) // block
    ends = list(range(chunk, num_blocks * block + 1, chunk))
    if partial is PartialChunkPolicy.KEEP and num_blocks * block % chunk:
        ends.append(num_blocks * block)
    assert chunks == tuple(block_chain(tokens[:end], block)[-1] for end in ends)


def test_regrouping_at_equal_granularity_is_the_identity() -> None:
    blocks = block_chain(list(range(40)), 4)
    assert regroup_block_hashes(blocks, 4, 4) == blocks


def test_regroup_needs_whole_blocks_per_chunk() -> None:
    with pytest.raises(ConfigError, match="chunk_tokens"):
        regroup_block_hashes((), 16, 24)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        regroup_block_hashes((), 16, 0)
    with pytest.raises(ConfigError, match="hash_block_tokens"):
        regroup_block_hashes((), 0, 16)
