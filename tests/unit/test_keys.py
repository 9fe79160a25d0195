"""Chunk keys: namespace fingerprints, shard ownership and rendering, keyed (secret) keys."""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.errors import ConfigError, UnsupportedConfiguration
from kvcore.keying.hashing import ChunkHasher, ExtraKeys, HashAlgorithm
from kvcore.keying.keys import Keyspace, Namespace, Shard, is_shard_writer

HASHER = ChunkHasher(HashAlgorithm.SHA256, b"seed", 16)
SECRET = b"s3cr3t-deployment-key"
TOKENS = list(range(64))


def namespace(**changes: Any) -> Namespace:
    base = Namespace(
        model_id="meta-llama/Llama-3.1-8B",
        epoch="2024-07",
        kv_dtype="bfloat16",
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        layout="flash_attn",
        block_tokens=16,
        chunk_tokens=256,
        hash_algorithm=HashAlgorithm.SHA256,
        hash_seed_digest=HASHER.seed_digest(),
    )
    return attrs.evolve(base, **changes)


SHARD = Shard(0, 32, 0, 8)
HASHES = HASHER.hash_tokens(TOKENS)


def keys(ns: Namespace, shard: Shard = SHARD, hashes: tuple[bytes, ...] = HASHES) -> tuple[str, ...]:
    return Keyspace(ns, shard).keys(hashes)


MUTATIONS: dict[str, Any] = {
    "model_id": "meta-llama/Llama-3.1-70B",
    "epoch": "2024-08",
    "kv_dtype": "float16",
    "num_layers": 33,
    "num_kv_heads": 4,
    "head_size": 64,
    "layout": "flash_infer",
    "block_tokens": 32,
    "chunk_tokens": 512,
    "hash_algorithm": HashAlgorithm.BLAKE2B,
    "hash_seed_digest": "ab" * 32,
    "secret": SECRET,
}


@given(fields=st.sets(st.sampled_from(sorted(MUTATIONS)), min_size=1))
@settings(max_examples=60)
def test_keys_differ_when_any_namespace_field_differs(fields: set[str]) -> None:
    # any non-empty set of changed fields -> every key changes
    base = keys(namespace())
    changed = keys(namespace(**{name: MUTATIONS[name] for name in fields}))
    assert all(a != b for a, b in zip(base, changed, strict=True))


def test_every_field_but_the_secret_is_in_the_fingerprint() -> None:
    assert set(MUTATIONS) == {f.name for f in attrs.fields(Namespace) if f.init}
    for name, value in MUTATIONS.items():
        changed = namespace(**{name: value}).fingerprint() != namespace().fingerprint()
        assert changed == (name != "secret"), name


def test_cache_salt_changes_every_key() -> None:
    salted = HASHER.hash_tokens(TOKENS, ExtraKeys(cache_salt="tenant-a"))
    other = HASHER.hash_tokens(TOKENS, ExtraKeys(cache_salt="tenant-b"))
    base, a, b = keys(namespace()), keys(namespace(), hashes=salted), keys(namespace(), hashes=other)
    assert all(len({x, y, z}) == 3 for x, y, z in zip(base, a, b, strict=True))


def test_key_rendering() -> None:
    ns = namespace()
    key = Keyspace(ns, SHARD).key(HASHES[0])
    assert key == f"kv/{ns.digest()}/l0-32.h0-8.c0.g0/{HASHES[0].hex()}"
    assert re.fullmatch(r"[0-9a-f]{32}", ns.digest())
    assert Keyspace(ns, SHARD).keys(HASHES)[0] == key


def test_epoch_bump_retires_every_key() -> None:
    old = namespace()
    new = old.with_epoch("2024-09")
    assert new.epoch == "2024-09"
    assert attrs.evolve(new, epoch=old.epoch) == old
    assert not set(keys(old)) & set(keys(new))


def test_secret_never_shows() -> None:
    ns = namespace(secret=SECRET)
    space = Keyspace(ns, SHARD)
    rendered = [repr(ns), str(ns), repr(space), str(space), *space.keys(HASHES)]
    for text in rendered:
        assert SECRET.decode() not in text
        assert SECRET.hex() not in text
        assert repr(SECRET) not in text
    assert "secret=<redacted>" in repr(ns)
    assert "secret=None" in repr(namespace())


def _derived(secret: bytes) -> bytes:
    """The HMAC key kvcore derives from a deployment secret: SHA-256 of its domain and the secret."""
    parts = [b"kvcore.secret.v1", secret]
    return hashlib.sha256(b"".join(struct.pack("<I", len(p)) + p for p in parts)).digest()


def test_keyed_keys_are_hmac_sha256_and_differ_from_unkeyed_and_between_secrets() -> None:
    plain = keys(namespace())
    keyed = keys(namespace(secret=SECRET))
    other = keys(namespace(secret=b"another secret"))
    long = keys(namespace(secret=b"x" * 100))
    for a, b, c, d in zip(plain, keyed, other, long, strict=True):
        assert len({a, b, c, d}) == 4
    ns = namespace(secret=SECRET)
    shard = SHARD.render().encode()
    message = ns.fingerprint() + struct.pack("<I", len(shard)) + shard + HASHES[1]
    expected = hmac.new(_derived(SECRET), message, hashlib.sha256).hexdigest()
    assert keyed[1] == f"kv/{ns.digest()}/{SHARD.render()}/{expected}"
    expected_long = hmac.new(_derived(b"x" * 100), message, hashlib.sha256).hexdigest()
    assert long[1].endswith(expected_long)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (b"s3cret", b"s3cret\0"),  # HMAC zero-pads a short key: these were one key
        (b"s3cret", b"s3cret\0\0\0"),
        (b"x" * 100, hashlib.sha256(b"x" * 100).digest()),  # HMAC hashes a long key: these were one key
        (b"\0", b"\0\0"),
    ],
    ids=["zero-padded", "zero-padded-thrice", "hashed-when-long", "nul"],
)
def test_two_different_secrets_never_give_one_namespace(one: bytes, other: bytes) -> None:
    assert not set(keys(namespace(secret=one))) & set(keys(namespace(secret=other)))


def test_shard_rendering_has_no_digit_ambiguity() -> None:
    # layers [1, 23) vs [12, 3) cannot both exist, but [1, 23) vs [12, 30) must not blur either
    assert Shard(1, 23, 0, 1).render() == "l1-23.h0-1.c0.g0"
    assert Shard(1, 23, 0, 1).render() != Shard(12, 30, 0, 1).render()
    assert Shard(0, 4, 0, 1, cp_rank=1, group=2).render() == "l0-4.h0-1.c1.g2"


shards = st.builds(
    lambda layer, layers, head, heads, cp, group: Shard(layer, layer + layers, head, head + heads, cp, group),
    st.integers(0, 200),
    st.integers(1, 200),
    st.integers(0, 200),
    st.integers(1, 200),
    st.integers(0, 20),
    st.integers(0, 20),
)


@given(a=shards, b=shards)
@settings(max_examples=200)
def test_shard_rendering_is_injective(a: Shard, b: Shard) -> None:
    assert (a.render() == b.render()) == (a == b)


def test_shard_ranges_are_validated() -> None:
    with pytest.raises(ConfigError, match="layer_stop"):
        Shard(4, 4, 0, 1)
    with pytest.raises(ConfigError, match="head_stop"):
        Shard(0, 4, 2, 1)
    with pytest.raises(ValueError, match="layer_start"):
        Shard(-1, 4, 0, 1)
    with pytest.raises(ValueError, match="cp_rank"):
        Shard(0, 4, 0, 1, cp_rank=-1)


def test_tp_split_when_heads_divide_evenly() -> None:
    # 8 KV heads over TP 4 -> rank r holds [2r, 2r + 2); all write
    assert [Shard.for_tp_rank(32, 8, 4, r).render() for r in range(4)] == [
        "l0-32.h0-2.c0.g0",
        "l0-32.h2-4.c0.g0",
        "l0-32.h4-6.c0.g0",
        "l0-32.h6-8.c0.g0",
    ]
    assert all(is_shard_writer(r, 4, 8) for r in range(4))


def test_replicated_heads_share_keys_and_the_lowest_rank_writes() -> None:
    # 2 KV heads over TP 8 -> ranks 0-3 hold head 0, ranks 4-7 head 1; ranks 0 and 4 write
    shards = [Shard.for_tp_rank(32, 2, 8, r) for r in range(8)]
    assert shards[:4] == [Shard(0, 32, 0, 1)] * 4
    assert shards[4:] == [Shard(0, 32, 1, 2)] * 4
    rank_keys = [keys(namespace(num_kv_heads=2), shard) for shard in shards]
    assert rank_keys[0] == rank_keys[3] != rank_keys[4] == rank_keys[7]
    assert [is_shard_writer(r, 8, 2) for r in range(8)] == [
        True,
        False,
        False,
        False,
        True,
        False,
        False,
        False,
    ]


def test_mla_has_one_head_range_and_one_writer() -> None:
    shards = {Shard.for_tp_rank(61, 1, 8, r, mla=True) for r in range(8)}
    assert shards == {Shard(0, 61, 0, 1)}
    assert [is_shard_writer(r, 8, 1, mla=True) for r in range(8)] == [True] + [False] * 7


def test_pipeline_stages_never_collide() -> None:
    # 32 layers over 2 stages -> [0, 16) and [16, 32): different keys for the same chunk
    first = Shard.for_tp_rank(16, 8, 2, 0)
    second = Shard.for_tp_rank(16, 8, 2, 0, layer_start=16)
    assert (first.layer_start, first.layer_stop, second.layer_start, second.layer_stop) == (0, 16, 16, 32)
    assert not set(keys(namespace(), first)) & set(keys(namespace(), second))


@pytest.mark.parametrize(("heads", "tp"), [(6, 4), (3, 4), (5, 2)])
def test_uneven_head_splits_are_refused(heads: int, tp: int) -> None:
    with pytest.raises(UnsupportedConfiguration, match=rf"{heads} KV heads.*{tp}|{tp}.*{heads} KV heads"):
        Shard.for_tp_rank(32, heads, tp, 0)
    with pytest.raises(UnsupportedConfiguration):
        is_shard_writer(0, tp, heads)


def test_bad_rank_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match="tp_rank"):
        Shard.for_tp_rank(32, 8, 4, 4)
    with pytest.raises(ConfigError, match="tp_size"):
        is_shard_writer(0, 0, 8)
    with pytest.raises(ConfigError, match="total_kv_heads"):
        Shard.for_tp_rank(32, 0, 4, 0)
    with pytest.raises(ConfigError, match="num_layers"):
        Shard.for_tp_rank(0, 8, 4, 0)


def test_namespace_validation() -> None:
    with pytest.raises(ConfigError, match="chunk_tokens"):
        namespace(chunk_tokens=100)
    with pytest.raises(ValueError, match="model_id"):
        namespace(model_id="")
    with pytest.raises(ValueError, match="num_layers"):
        namespace(num_layers=0)
    with pytest.raises(ValueError, match="hash_seed_digest"):
        namespace(hash_seed_digest="not hex")
    with pytest.raises(ValueError, match="secret"):
        namespace(secret=b"")
