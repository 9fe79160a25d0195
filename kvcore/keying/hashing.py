"""Chained chunk hashing: the content half of every chunk key.

A chunk's hash stands for its whole prefix: ``h_i = H(h_{i-1} || tokens of chunk i || extra keys of
chunk i)``, with ``h_{-1}`` derived from an explicit seed. Two requests share a chunk hash only if they
share every token before the chunk's end and every per-request extra key (cache salt, LoRA, multimodal
items) that vLLM folds into its own block hashes. Inside vLLM the engine's per-block hashes are already
such a chain, so ``regroup_block_hashes`` picks chunk hashes out of them without hashing a token again.

The seed is always explicit: a random or environment-derived seed would give every process different
keys, and a shared tier would then never hit.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from attrs import field, frozen

from kvcore.checks import instance, int_in, text
from kvcore.errors import ConfigError, InvalidSpecError

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "NO_EXTRA",
    "ChunkHasher",
    "ExtraKeys",
    "HashAlgorithm",
    "MMSpan",
    "PartialChunkPolicy",
    "regroup_block_hashes",
]

DEFAULT_CHUNK_TOKENS = 256

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Token ids are hashed as little-endian 32-bit words on every platform.
_TOKEN_CODE = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"
_SEED_DOMAIN = b"kvcore.chunk-hash.v1"
_FOLD_DOMAIN = b"kvcore.extra-fold.v1"
_DIGEST_SIZE = 32


class HashAlgorithm(enum.Enum):
    """Digest used for the chain; both from the standard library, 32-byte digests."""

    SHA256 = "sha256"
    BLAKE2B = "blake2b"


class PartialChunkPolicy(enum.Enum):
    """What happens to the tokens after the last full chunk: in ``ChunkHasher``, whether a trailing
    partial chunk is hashed (its token count hashed with it); in ``KVCoreConfig.partial_chunks``,
    whether the whole blocks of the chunk a request stops in are kept (tails, ``Keyer.tail_key``)."""

    DROP = "drop"
    KEEP = "keep"


class _Digest(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...


def _digest_factory(algorithm: HashAlgorithm) -> Callable[[bytes], _Digest]:
    if algorithm is HashAlgorithm.BLAKE2B:
        return functools.partial(hashlib.blake2b, digest_size=_DIGEST_SIZE)
    return hashlib.sha256


def _record(tag: bytes, payload: bytes) -> bytes:
    """One self-delimiting extra-key record: a tag byte, a 32-bit length, the payload."""
    return tag + _U32.pack(len(payload)) + payload


def _utf8(value: str, name: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidSpecError(f"{name}: {value!r} is not encodable as UTF-8") from exc


def _optional_text(name: str, value: object) -> str | None:
    """An optional text key: as in vLLM, ``None`` or an empty string means none; anything that is not a
    string is refused (a salt of ``0`` must not silently become "no salt")."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidSpecError(f"{name}: got {value!r}, expected a string or None")
    return value


def _salt(value: object) -> str | None:
    return _optional_text("cache_salt", value)


def _lora(value: object) -> str | None:
    return _optional_text("lora_id", value)


def _spans(value: object) -> tuple[MMSpan, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidSpecError(f"mm: got {value!r}, expected a sequence of MMSpan")
    spans = tuple(value)
    for span in spans:
        if not isinstance(span, MMSpan):
            raise InvalidSpecError(f"mm: got {span!r}, expected MMSpan items")
    return tuple(sorted(spans, key=lambda s: (s.offset, s.length, s.mm_hash)))


@frozen
class MMSpan:
    """One multimodal item: its content hash and the prompt tokens its placeholder occupies."""

    mm_hash: str = field(validator=text)
    offset: int = field(validator=int_in(0, 2**64 - 1))
    length: int = field(validator=int_in(1, 2**64 - 1))

    @property
    def end(self) -> int:
        """One past the item's last token."""
        return self.offset + self.length


@frozen
class ExtraKeys:
    """Per-request keys folded into the chain, as vLLM folds them into its block hashes.

    ``cache_salt`` goes into the request's first chunk only (so it changes every chunk hash),
    ``lora_id`` into every chunk, and each multimodal item into every chunk its tokens overlap.
    """

    cache_salt: str | None = field(default=None, converter=_salt)
    lora_id: str | None = field(default=None, converter=_lora)
    mm: tuple[MMSpan, ...] = field(default=(), converter=_spans)
    _salt_record: bytes = field(init=False, repr=False, eq=False)
    _lora_record: bytes = field(init=False, repr=False, eq=False)
    _mm_records: tuple[bytes, ...] = field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        salt = b"" if self.cache_salt is None else _record(b"S", _utf8(self.cache_salt, "cache_salt"))
        lora = b"" if self.lora_id is None else _record(b"L", _utf8(self.lora_id, "lora_id"))
        mm = tuple(
            _record(b"M", _U64.pack(s.offset) + _U64.pack(s.length) + _utf8(s.mm_hash, "mm_hash"))
            for s in self.mm
        )
        object.__setattr__(self, "_salt_record", salt)
        object.__setattr__(self, "_lora_record", lora)
        object.__setattr__(self, "_mm_records", mm)

    @property
    def empty(self) -> bool:
        """Whether there is no key at all (then hashes are those of the tokens alone)."""
        return self.cache_salt is None and self.lora_id is None and not self.mm


NO_EXTRA = ExtraKeys()


def _tokens_to_bytes(tokens: Sequence[int]) -> memoryview:
    words = array(_TOKEN_CODE)
    try:
        words.fromlist(tokens if isinstance(tokens, list) else list(tokens))
    except (OverflowError, TypeError) as exc:
        raise InvalidSpecError(f"token ids must be ints in [0, 2**32): {exc}") from exc
    if _BIG_ENDIAN:
        words.byteswap()
    return memoryview(words).cast("B")


@frozen
class ChunkHasher:
    """Hashes token sequences into chained chunk hashes.

    ``seed`` is required and explicit: every process that shares a tier must use the same one.
    Chunk hashes of a prefix are a prefix of the chunk hashes of the whole sequence.
    """

    algorithm: HashAlgorithm = field(validator=instance(HashAlgorithm))
    seed: bytes = field(validator=instance(bytes), repr=False)
    chunk_tokens: int = field(default=DEFAULT_CHUNK_TOKENS, validator=int_in(1, 2**40))
    partial: PartialChunkPolicy = field(
        default=PartialChunkPolicy.DROP, validator=instance(PartialChunkPolicy)
    )
    _new: Callable[[bytes], _Digest] = field(init=False, repr=False, eq=False)
    _root: bytes = field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        new = _digest_factory(self.algorithm)
        name = self.algorithm.value.encode()
        root = new(_SEED_DOMAIN + _U32.pack(len(name)) + name + self.seed).digest()
        object.__setattr__(self, "_new", new)
        object.__setattr__(self, "_root", root)

    def seed_digest(self) -> str:
        """Hex digest of the seed (the chain's root); goes into the namespace."""
        return self._root.hex()

    def fold_extra(
        self, chunk_hashes: Sequence[bytes], counts: Sequence[int], extra: ExtraKeys, *, start: int = 0
    ) -> tuple[bytes, ...]:
        """Chunk hashes taken from an engine's chain, with per-request keys the chain may lack folded in.

        An engine's block hashes (``regroup_block_hashes``) may or may not include a cache salt, LoRA or
        multimodal items; when the caller passes ``extra`` they are folded in here, never dropped: chunk
        ``i`` becomes ``H(domain || h_i || salt || LoRA || every item that starts before the chunk's
        end)`` (the hash has a fixed size, each key record delimits itself). That keeps the hashes
        prefix-monotone (an item later in the prompt changes no earlier chunk) and makes two salts,
        adapters or images never share a chunk. ``counts`` are the chunks' token counts, the first chunk
        starting at token ``start``. Without keys (``extra.empty``) the hashes are returned as they are.
        """
        if extra.empty:
            return tuple(chunk_hashes)
        if len(counts) != len(chunk_hashes):
            raise InvalidSpecError(f"{len(chunk_hashes)} chunk hashes, but {len(counts)} token counts")
        keys = extra._salt_record + extra._lora_record
        spans = tuple(zip(extra.mm, extra._mm_records, strict=True))
        folded: list[bytes] = []
        end = start
        for chunk_hash, count in zip(chunk_hashes, counts, strict=True):
            end += count
            digest = self._new(_FOLD_DOMAIN + chunk_hash)
            digest.update(keys)
            for span, record in spans:
                if span.offset < end:
                    digest.update(record)
            folded.append(digest.digest())
        return tuple(folded)

    def chunk_token_counts(self, num_tokens: int) -> tuple[int, ...]:
        """Token count of each chunk hashed out of ``num_tokens`` tokens, per the partial policy."""
        if num_tokens < 0:
            raise InvalidSpecError(f"num_tokens must be >= 0, got {num_tokens}")
        full, rest = divmod(num_tokens, self.chunk_tokens)
        counts = (self.chunk_tokens,) * full
        if rest and self.partial is PartialChunkPolicy.KEEP:
            return (*counts, rest)
        return counts

    def hash_tokens(
        self,
        tokens: Sequence[int],
        extra: ExtraKeys = NO_EXTRA,
        parent: bytes | None = None,
        *,
        start: int = 0,
    ) -> tuple[bytes, ...]:
        """Chunk hashes of ``tokens``, one per chunk of ``chunk_token_counts(len(tokens))``.

        To continue a chain, pass the last full chunk's hash as ``parent`` and the position of
        ``tokens[0]`` in the request as ``start`` (a multiple of ``chunk_tokens``): the result then
        equals the tail of hashing the whole request at once. Multimodal offsets always count from the
        request's first token.
        """
        if start < 0 or start % self.chunk_tokens:
            raise InvalidSpecError(f"start must be a multiple of chunk_tokens >= 0, got {start}")
        if (parent is None) != (start == 0):
            raise InvalidSpecError(
                "parent and start go together: a chain continued at start > 0 needs parent"
            )
        if parent is not None and len(parent) != _DIGEST_SIZE:
            raise InvalidSpecError(
                f"parent must be a {_DIGEST_SIZE}-byte chunk hash, got {len(parent)} bytes"
            )
        data = _tokens_to_bytes(tokens)
        step = 4 * self.chunk_tokens
        new = self._new
        prev = self._root if parent is None else parent
        hashes: list[bytes] = []
        for first, stop, tail in self._runs(self.chunk_token_counts(len(tokens)), extra, start):
            # A partial chunk is always last: its slice simply ends where the data does.
            for pos in range(first * step, stop * step, step):
                digest = new(prev)
                digest.update(data[pos : pos + step])
                digest.update(tail)
                prev = digest.digest()
                hashes.append(prev)
        return tuple(hashes)

    def _runs(self, counts: tuple[int, ...], extra: ExtraKeys, start: int) -> list[tuple[int, int, bytes]]:
        """``(first, stop, tail)`` runs of chunks that share the bytes hashed after their tokens.

        A tail is the chunk's extra-key records (salt, LoRA, multimodal items: self-delimiting, in that
        order) and then its token count, so that the token bytes after the fixed-size parent are
        delimited. Most chunks share one tail; only the salted first chunk, chunks under a multimodal
        item and a partial last chunk differ, each in a run of its own.
        """
        chunk = self.chunk_tokens
        covered_end = start + sum(counts)
        mm_records: dict[int, list[bytes]] = {}
        for span, record in zip(extra.mm, extra._mm_records, strict=True):
            lo, hi = max(span.offset, start), min(span.end, covered_end)
            if lo < hi:
                for i in range((lo - start) // chunk, (hi - 1 - start) // chunk + 1):
                    mm_records.setdefault(i, []).append(record)
        special = set(mm_records)
        salted = start == 0 and bool(extra._salt_record)
        if salted and counts:
            special.add(0)
        if counts and counts[-1] != chunk:
            special.add(len(counts) - 1)
        plain = extra._lora_record + _U32.pack(chunk)
        runs = []
        first = 0
        for i in sorted(special):
            if first < i:
                runs.append((first, i, plain))
            salt = extra._salt_record if salted and i == 0 else b""
            tail = b"".join((salt, extra._lora_record, *mm_records.get(i, ()), _U32.pack(counts[i])))
            runs.append((i, i + 1, tail))
            first = i + 1
        if first < len(counts):
            runs.append((first, len(counts), plain))
        return runs


def regroup_block_hashes(
    block_hashes: Sequence[bytes],
    hash_block_tokens: int,
    chunk_tokens: int,
    policy: PartialChunkPolicy = PartialChunkPolicy.DROP,
) -> tuple[bytes, ...]:
    """Chunk hashes taken from an engine's chained per-block hashes, hashing nothing.

    The last block hash of each chunk already stands for the chunk's whole prefix, so it is the chunk
    hash. With ``KEEP``, a trailing partial chunk (whole blocks only) is keyed by its last block's hash.
    """
    if hash_block_tokens < 1:
        raise ConfigError("hash_block_tokens", hash_block_tokens, "an int >= 1")
    if chunk_tokens < 1 or chunk_tokens % hash_block_tokens:
        raise ConfigError("chunk_tokens", chunk_tokens, f"a positive multiple of {hash_block_tokens}")
    per_chunk = chunk_tokens // hash_block_tokens
    chunks = tuple(block_hashes[per_chunk - 1 :: per_chunk])
    if policy is PartialChunkPolicy.KEEP and len(block_hashes) % per_chunk:
        return (*chunks, block_hashes[-1])
    return chunks
