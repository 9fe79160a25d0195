"""Chunk keys: which deployment (namespace), which part of the KV (shard), which prefix (chunk hash).

A key must differ whenever the stored bytes could differ, and be equal whenever they cannot: the
namespace holds every deployment fact that changes KV bytes, the shard says which layers, heads and
ranks a worker holds, and the chunk hash stands for the tokens. Ranks that hold the same heads share
keys (one of them writes, see ``is_shard_writer``). With a deployment secret the chunk part is an HMAC, so a
client without the secret can neither predict nor plant keys.

The namespace holds no parallel split: an engine at any tensor-parallel size keys a chunk alike, and only
the shard says which heads a value holds. A tier that keeps one value per KV head (``HeadKeyspaces``) is
so shared by engines at every TP size: the key of head ``h`` is the same whichever rank wrote it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import cast

import attrs
from attrs import field, frozen
from attrs.validators import and_, ge, instance_of, matches_re, min_len, optional

from kvcore.errors import ConfigError, UnsupportedConfiguration
from kvcore.ids import ChunkKey
from kvcore.keying.hashing import HashAlgorithm

__all__ = [
    "HEAD_SEPARATOR",
    "HeadKeyspaces",
    "Keyspace",
    "Namespace",
    "Shard",
    "head_keys",
    "is_shard_writer",
    "lookup_keys",
]

_U32 = struct.Struct("<I")
_NAMESPACE_DOMAIN = b"kvcore.namespace.v1"
_SECRET_DOMAIN = b"kvcore.secret.v1"
_NS_DIGEST_BYTES = 16
_HMAC_BLOCK = 64  # SHA-256's block size, as RFC 2104 needs it

_text = and_(instance_of(str), min_len(1))


def _redacted(secret: bytes | None) -> str:
    return "None" if secret is None else "<redacted>"


def _chunk_multiple_of_block(instance: Namespace, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1 or value % instance.block_tokens:
        raise ConfigError(
            attribute.name, value, f"a positive multiple of block_tokens ({instance.block_tokens})"
        )


def _length_prefixed(parts: Sequence[bytes]) -> bytes:
    return b"".join(_U32.pack(len(part)) + part for part in parts)


@frozen
class Namespace:
    """Deployment facts that must all match for stored KV to be reusable.

    ``epoch`` names a weights version: bumping it (``with_epoch``) retires every key an instance wrote
    without wiping a pool that other instances share. ``secret`` never appears in ``repr`` or in a key.
    """

    model_id: str = field(validator=_text)
    epoch: str = field(validator=_text)
    kv_dtype: str = field(validator=_text)
    num_layers: int = field(validator=ge(1))
    num_kv_heads: int = field(validator=ge(1))
    head_size: int = field(validator=ge(1))
    layout: str = field(validator=_text)
    block_tokens: int = field(validator=ge(1))
    chunk_tokens: int = field(validator=_chunk_multiple_of_block)
    hash_algorithm: HashAlgorithm = field(validator=instance_of(HashAlgorithm))
    hash_seed_digest: str = field(validator=matches_re(r"[0-9a-f]+"))
    secret: bytes | None = field(
        default=None, repr=_redacted, validator=optional(and_(instance_of(bytes), min_len(1)))
    )
    _fingerprint: bytes = field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        rendered = _length_prefixed(
            [
                _NAMESPACE_DOMAIN,
                *(
                    str(value).encode()
                    for value in (
                        self.model_id,
                        self.epoch,
                        self.kv_dtype,
                        self.num_layers,
                        self.num_kv_heads,
                        self.head_size,
                        self.layout,
                        self.block_tokens,
                        self.chunk_tokens,
                        self.hash_algorithm.value,
                        self.hash_seed_digest,
                    )
                ),
            ]
        )
        object.__setattr__(self, "_fingerprint", hashlib.sha256(rendered).digest())

    def fingerprint(self) -> bytes:
        """SHA-256 over a canonical rendering of every field except the secret."""
        return self._fingerprint

    def digest(self) -> str:
        """Short hex form of the fingerprint, as it appears in keys."""
        return self._fingerprint[:_NS_DIGEST_BYTES].hex()

    def with_epoch(self, epoch: str) -> Namespace:
        """The same deployment under a new weights epoch: none of the old keys match."""
        return attrs.evolve(self, epoch=epoch)


def _above(start_name: str) -> Callable[[object, attrs.Attribute[int], int], None]:
    """Validator of a range's stop: it must exceed the field ``start_name``."""

    def check(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
        start = getattr(instance, start_name)
        if value <= start:
            raise ConfigError(attribute.name, value, f"greater than {start_name} ({start})")

    return check


@frozen
class Shard:
    """The part of one chunk's KV that one worker holds.

    Layers ``[layer_start, layer_stop)`` (a pipeline stage), KV heads ``[head_start, head_stop)`` (after
    tensor parallelism; MLA: ``[0, 1)``), the context-parallel rank and the KV-cache group.
    """

    layer_start: int = field(validator=ge(0))
    layer_stop: int = field(validator=_above("layer_start"))
    head_start: int = field(validator=ge(0))
    head_stop: int = field(validator=_above("head_start"))
    cp_rank: int = field(default=0, validator=ge(0))
    group: int = field(default=0, validator=ge(0))

    def render(self) -> str:
        """Canonical text, e.g. ``l0-32.h0-4.c0.g0``; distinct shards never render alike."""
        return (
            f"l{self.layer_start}-{self.layer_stop}.h{self.head_start}-{self.head_stop}"
            f".c{self.cp_rank}.g{self.group}"
        )

    def heads(self) -> tuple[Shard, ...]:
        """The shard cut into one shard per KV head it holds, in head order."""
        return tuple(
            attrs.evolve(self, head_start=h, head_stop=h + 1) for h in range(self.head_start, self.head_stop)
        )

    @classmethod
    def for_tp_rank(
        cls,
        num_layers: int,
        total_kv_heads: int,
        tp_size: int,
        tp_rank: int,
        *,
        mla: bool = False,
        layer_start: int = 0,
        cp_rank: int = 0,
        group: int = 0,
    ) -> Shard:
        """The shard tensor-parallel rank ``tp_rank`` holds, by vLLM's head ownership rule."""
        if num_layers < 1:
            raise ConfigError("num_layers", num_layers, "an int >= 1")
        head_start, head_stop, _ = _head_ownership(total_kv_heads, tp_size, tp_rank, mla)
        return cls(layer_start, layer_start + num_layers, head_start, head_stop, cp_rank, group)


HEAD_SEPARATOR = ","
"""Between the keys of a rank's heads in its key for a tier that keeps values per head (never in a key)."""


def head_keys(key: ChunkKey) -> tuple[ChunkKey, ...]:
    """The keys of each KV head in a rank's key that ``HeadKeyspaces`` rendered, in head order (a rank of
    one head: its own key)."""
    return cast(tuple[ChunkKey, ...], tuple(key.split(HEAD_SEPARATOR)))


def lookup_keys(shards: Sequence[ChunkKey], *, per_head: bool) -> tuple[ChunkKey, ...]:
    """What a lookup asks a tier for one chunk, given every rank's key of it (replicas repeat theirs):
    each key once, or, for a tier that keeps values per KV head (the ranks' keys rendered by
    ``HeadKeyspaces``), each head's key once: the chunk counts only where every head is present, whoever
    wrote it."""
    if not per_head:
        return tuple(dict.fromkeys(shards))
    return tuple(dict.fromkeys(head for key in shards for head in head_keys(key)))


def _head_ownership(total_kv_heads: int, tp_size: int, tp_rank: int, mla: bool) -> tuple[int, int, int]:
    """``(head_start, head_stop, replicas)`` for one rank, as vLLM splits KV heads across TP ranks."""
    if tp_size < 1:
        raise ConfigError("tp_size", tp_size, "an int >= 1")
    if not 0 <= tp_rank < tp_size:
        raise ConfigError("tp_rank", tp_rank, f"in [0, {tp_size})")
    if total_kv_heads < 1:
        raise ConfigError("total_kv_heads", total_kv_heads, "an int >= 1")
    if mla:
        return 0, 1, tp_size
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise UnsupportedConfiguration(
                f"{total_kv_heads} KV heads cannot be split evenly across tensor-parallel size {tp_size}"
            )
        per_rank = total_kv_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank, 1
    if tp_size % total_kv_heads:
        raise UnsupportedConfiguration(
            f"tensor-parallel size {tp_size} is not a multiple of the {total_kv_heads} KV heads to replicate"
        )
    replicas = tp_size // total_kv_heads
    head = tp_rank // replicas
    return head, head + 1, replicas


def is_shard_writer(tp_rank: int, tp_size: int, total_kv_heads: int, *, mla: bool = False) -> bool:
    """Whether ``tp_rank`` stores its shard: among ranks holding the same heads, only the lowest writes."""
    _, _, replicas = _head_ownership(total_kv_heads, tp_size, tp_rank, mla)
    return tp_rank % replicas == 0


def _hmac_pads(secret: bytes) -> tuple[bytes, bytes]:
    """HMAC-SHA256's inner and outer key blocks (RFC 2104), computed once per keyspace, for the key
    derived from ``secret`` by a hash under kvcore's own domain: HMAC's own use of a key (zero-padded to
    the block, hashed only when longer) would give ``s3cret`` and ``s3cret\\0`` one key, and a secret one
    namespace with its SHA-256."""
    key = hashlib.sha256(_length_prefixed([_SECRET_DOMAIN, secret])).digest().ljust(_HMAC_BLOCK, b"\0")
    return bytes(b ^ 0x36 for b in key), bytes(b ^ 0x5C for b in key)


@frozen
class Keyspace:
    """Renders chunk keys for one namespace and shard: ``kv/<namespace digest>/<shard>/<chunk>``.

    Without a secret the chunk part is the chunk hash in hex. With one it is
    ``HMAC-SHA256(K, fingerprint || shard || chunk hash)`` in hex, where ``K = SHA-256(domain || secret)``
    (length-prefixed): every secret, whatever its length or trailing bytes, has a key of its own.
    """

    namespace: Namespace = field(validator=instance_of(Namespace))
    shard: Shard = field(validator=instance_of(Shard))
    _prefix: str = field(init=False, repr=False, eq=False)
    # HMAC states with the key (and, inside, the fixed message prefix) already absorbed: a key then
    # costs two copies and two short updates instead of hmac.new's per-call set-up.
    _inner: hashlib._Hash | None = field(init=False, repr=False, eq=False)
    _outer: hashlib._Hash | None = field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        shard = self.shard.render()
        object.__setattr__(self, "_prefix", f"kv/{self.namespace.digest()}/{shard}/")
        inner = outer = None
        if self.namespace.secret is not None:
            inner_pad, outer_pad = _hmac_pads(self.namespace.secret)
            inner = hashlib.sha256(inner_pad)
            inner.update(self.namespace.fingerprint() + _length_prefixed([shard.encode()]))
            outer = hashlib.sha256(outer_pad)
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_outer", outer)

    def key(self, chunk_hash: bytes) -> ChunkKey:
        """The key of one chunk."""
        return self.keys((chunk_hash,))[0]

    def keys(self, chunk_hashes: Sequence[bytes]) -> tuple[ChunkKey, ...]:
        """The keys of many chunks, in order."""
        prefix, inner, outer = self._prefix, self._inner, self._outer
        if inner is None or outer is None:
            rendered = tuple([prefix + h.hex() for h in chunk_hashes])
        else:
            rendered = tuple([prefix + _mac(inner, outer, h) for h in chunk_hashes])
        return cast(tuple[ChunkKey, ...], rendered)


@frozen
class HeadKeyspaces:
    """Renders a rank's key of a chunk for a tier that keeps a value per KV head: the keys of its heads,
    each its one-head shard's ``Keyspace`` key, joined by ``HEAD_SEPARATOR`` (``head_keys`` splits it).

    A head's key is the same whichever TP size holds it (its shard renders alike), so engines of every TP
    size share the values; with a secret each head's key is a MAC of its own, so a key seen tells
    nothing of its sibling heads' (the scheduler renders them all: a worker only splits).
    """

    keyspaces: tuple[Keyspace, ...]

    @classmethod
    def for_shard(cls, namespace: Namespace, shard: Shard) -> HeadKeyspaces:
        """The keyspaces of each head of ``shard``."""
        return cls(tuple(Keyspace(namespace, head) for head in shard.heads()))

    def keys(self, chunk_hashes: Sequence[bytes]) -> tuple[ChunkKey, ...]:
        """Each chunk's joined key, in order."""
        per_head = [keyspace.keys(chunk_hashes) for keyspace in self.keyspaces]
        return cast(
            tuple[ChunkKey, ...], tuple(HEAD_SEPARATOR.join(keys) for keys in zip(*per_head, strict=True))
        )


def _mac(inner: hashlib._Hash, outer: hashlib._Hash, message_tail: bytes) -> str:
    first = inner.copy()
    first.update(message_tail)
    second = outer.copy()
    second.update(first.digest())
    return second.hexdigest()
