"""Keying a request: its chunk hashes and the keys of each chunk, for the local pool and for each rank.

A request's keys come from its tokens (hashed here, with its extra keys) or from the engine's own chained
block hashes (regrouped into chunk hashes, extra keys folded in). They grow as decode extends the request
(a chunk is keyed once it is full), and are rendered again under a new namespace epoch after a reset.
With ``partial_chunks: keep`` the leading whole blocks of a chunk have keys too (``Keyer.tail_key``): a
*tail* of ``k`` blocks is hashed like a chunk of ``k`` blocks' tokens, so its key differs from the full
chunk's and from every other tail's. ``Keyer`` owns the deployment side (hasher, namespace, keyspaces,
which ranks write a shared tier); ``ChunkChain`` is one request's keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import cast

import attrs

from kvcore.checks import is_int_in
from kvcore.config.model import KVCoreConfig
from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey
from kvcore.keying.hashing import ChunkHasher, ExtraKeys, PartialChunkPolicy, regroup_block_hashes
from kvcore.keying.keys import HeadKeyspaces, Keyspace, Namespace, Shard, is_shard_writer
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import LayoutKind

__all__ = ["ChunkChain", "Keyer", "prompt_tokens", "token_sequence"]


class ChunkChain:
    """One request's chunks: hashes, token counts, the pool's key of each chunk and, with a shared tier,
    each rank's shard key (``rank_keys[chunk][rank]``). ``by_hashes``: keyed from the engine's block
    hashes (a request keeps the kind of key it was looked up with). ``source`` is what the keys were
    last taken from (the tokens, or the block hashes of ``hash_block_tokens`` tokens each): the keys of
    tails are taken from it when asked for."""

    __slots__ = (
        "by_hashes",
        "extra",
        "hash_block_tokens",
        "hashes",
        "keys",
        "rank_keys",
        "source",
        "token_counts",
    )

    def __init__(self, extra: ExtraKeys, by_hashes: bool) -> None:
        self.extra = extra
        self.by_hashes = by_hashes
        self.source: Sequence[object] = ()
        self.hash_block_tokens = 1
        self.hashes: tuple[bytes, ...] = ()
        self.token_counts: tuple[int, ...] = ()
        self.keys: tuple[ChunkKey, ...] = ()
        self.rank_keys: tuple[tuple[ChunkKey, ...], ...] = ()

    def full_chunks(self, chunk_tokens: int) -> int:
        """Leading chunks keyed with all their tokens (a trailing partial one is not)."""
        counts = self.token_counts
        return len(counts) - 1 if counts and counts[-1] != chunk_tokens else len(counts)


class Keyer:
    """Keys requests for one engine. ``shard_keys``: render each rank's shard key too (a shared tier
    keys each rank's shard; the local pool keys the whole engine's, one pool serving every rank);
    ``head_keys``: each rank's key is its heads' keys joined (``HeadKeyspaces``: a tier behind keeps a
    value per KV head, and splits them)."""

    def __init__(
        self,
        config: KVCoreConfig,
        engine: EngineSpec,
        *,
        hash_identity: str | None,
        shard_keys: bool,
        head_keys: bool = False,
    ) -> None:
        self.chunk_tokens = config.chunk_tokens
        self._block_tokens = engine.layout.block_tokens
        self.tails = (
            config.partial_chunks is PartialChunkPolicy.KEEP and self.chunk_tokens > self._block_tokens
        )
        """Whether the leading whole blocks of a chunk are keyed (``tail_key``) and kept (a chunk of one
        block has none)."""
        self._epoch = config.epoch
        self._engine = engine
        self._shard_keys = shard_keys
        self._head_keys = head_keys
        self._mla = engine.layout.kind is LayoutKind.MLA
        self.hasher = ChunkHasher(
            algorithm=config.hash_algorithm,
            seed=config.hash_seed.encode(),
            chunk_tokens=config.chunk_tokens,
        )
        self._tail_hasher = attrs.evolve(self.hasher, partial=PartialChunkPolicy.KEEP)
        layout = engine.layout
        self._use(
            Namespace(
                model_id=engine.model_id,
                epoch=config.epoch,
                kv_dtype=engine.kv_dtype,
                num_layers=engine.num_layers,
                num_kv_heads=engine.total_kv_heads,
                head_size=layout.head_size,
                layout=layout.name,
                block_tokens=layout.block_tokens,
                chunk_tokens=config.chunk_tokens,
                hash_algorithm=config.hash_algorithm,
                hash_seed_digest=(
                    self.hasher.seed_digest()
                    if hash_identity is None
                    else hashlib.sha256(hash_identity.encode()).hexdigest()
                ),
                secret=config.secret.encode() if config.secret is not None else None,
            )
        )
        world = engine.tp_size
        self.shard_writers = tuple(
            is_shard_writer(r, world, engine.total_kv_heads, mla=self._mla) for r in range(world)
        )
        """Whether each rank writes its shard to a shared tier (of replicas, only the lowest rank)."""

    def new_epoch(self, label: str) -> None:
        """Key under the configured epoch suffixed with ``label``: every key rendered before is
        unreachable (chains must be rendered again, ``refresh``)."""
        self._use(self.keyspace.namespace.with_epoch(f"{self._epoch}~{label}"))

    def chain(
        self,
        extra: ExtraKeys,
        tokens: Sequence[int] | None,
        block_hashes: Sequence[bytes] | None,
        hash_block_tokens: int | None,
    ) -> ChunkChain:
        """A request's chain, from its ``tokens`` or from the engine's ``block_hashes`` (of
        ``hash_block_tokens`` tokens each). Raises ``InvalidSpecError`` for bad hashes or tokens."""
        chain = ChunkChain(extra, by_hashes=block_hashes is not None)
        if block_hashes is not None:
            self.rekey(chain, block_hashes, hash_block_tokens)
        elif tokens is not None:
            chain.source = tuple(tokens)  # a copy: the caller may reuse its list
            chain.hashes = self.hasher.hash_tokens(tokens, extra)
            chain.token_counts = self.hasher.chunk_token_counts(len(tokens))
            self.refresh(chain)
        else:
            raise InvalidSpecError("lookup needs tokens or block_hashes")
        return chain

    def rekey(self, chain: ChunkChain, block_hashes: object, hash_block_tokens: object) -> int:
        """Key ``chain`` again from the engine's block hashes (grown since); returns the first chunk whose
        key changed (``len`` of the old keys, unless the namespace changed)."""
        hashes = _block_hashes(block_hashes)
        per_hash = _hash_block_tokens(hash_block_tokens)
        old = chain.keys
        chain.source, chain.hash_block_tokens = tuple(hashes), per_hash
        grouped = regroup_block_hashes(hashes, per_hash, self.chunk_tokens)
        chain.token_counts = self.hasher.chunk_token_counts(len(hashes) * per_hash)
        chain.hashes = self.hasher.fold_extra(grouped, chain.token_counts, chain.extra)
        self.refresh(chain)
        return next((i for i, (a, b) in enumerate(zip(old, chain.keys, strict=False)) if a != b), len(old))

    def extend(self, chain: ChunkChain, tokens: Sequence[int]) -> int:
        """Key ``chain``'s chunks past its full ones from ``tokens`` (the request's tokens from its first
        on); returns the first chunk whose key changed."""
        full = chain.full_chunks(self.chunk_tokens)
        chain.source = tuple(tokens)
        chain.hashes, chain.token_counts = chain.hashes[:full], chain.token_counts[:full]
        chain.keys, chain.rank_keys = chain.keys[:full], chain.rank_keys[:full]
        known = sum(chain.token_counts)
        parent = chain.hashes[-1] if chain.hashes else None
        more = self.hasher.hash_tokens(tokens[known:], chain.extra, parent, start=known)
        chain.hashes += more
        chain.token_counts += self.hasher.chunk_token_counts(len(tokens) - known)
        chain.keys += self.keyspace.keys(more)
        chain.rank_keys += self._ranked(more)
        return full

    def follow(
        self,
        chain: ChunkChain,
        tokens: Sequence[int] | None,
        block_hashes: Sequence[bytes] | None,
        hash_block_tokens: int | None,
    ) -> None:
        """Take ``chain``'s tail keys from these tokens or block hashes (of the kind it was keyed from)
        from now on, without rendering its chunk keys again; raises ``InvalidSpecError`` for bad ones."""
        if chain.by_hashes and block_hashes is not None:
            chain.source = tuple(_block_hashes(block_hashes))
            if hash_block_tokens is not None:
                chain.hash_block_tokens = _hash_block_tokens(hash_block_tokens)
        elif not chain.by_hashes and tokens is not None:
            chain.source = tuple(token_sequence(tokens))

    def tail_key(self, chain: ChunkChain, chunk: int, blocks: int) -> ChunkKey | None:
        """The pool's key of the first ``blocks`` engine blocks of chunk ``chunk`` (a tail: fewer blocks
        than a chunk), or ``None`` where ``chain`` does not know their tokens yet (or the engine's hash
        blocks do not end where the tail does). ``chunk`` is at most the chain's count of full chunks."""
        tail = self._tail_hash(chain, chunk, blocks)
        return None if tail is None else self.keyspace.keys((tail,))[0]

    def tail_keys(
        self, chain: ChunkChain, chunk: int, blocks: int
    ) -> tuple[ChunkKey, tuple[ChunkKey, ...]] | None:
        """``tail_key`` and, with a shared tier, each rank's shard key of the same tail (as
        ``ChunkChain.rank_keys`` for a chunk; empty without one)."""
        tail = self._tail_hash(chain, chunk, blocks)
        if tail is None:
            return None
        ranked = self._ranked((tail,))
        return self.keyspace.keys((tail,))[0], ranked[0] if ranked else ()

    def _tail_hash(self, chain: ChunkChain, chunk: int, blocks: int) -> bytes | None:
        start = chunk * self.chunk_tokens
        count = blocks * self._block_tokens
        end = start + count
        if not (0 < count < self.chunk_tokens and 0 <= chunk <= len(chain.hashes)):
            return None
        if chain.by_hashes:
            per_hash = chain.hash_block_tokens
            if end % per_hash or end // per_hash > len(chain.source):
                return None
            last = cast(bytes, chain.source[end // per_hash - 1])
            hashes = self.hasher.fold_extra((last,), (count,), chain.extra, start=start)
        else:
            if end > len(chain.source):
                return None
            parent = chain.hashes[chunk - 1] if chunk else None
            tokens = cast(Sequence[int], chain.source[start:end])
            hashes = self._tail_hasher.hash_tokens(tokens, chain.extra, parent, start=start)
        return hashes[0]

    def refresh(self, chain: ChunkChain) -> None:
        """Render ``chain``'s keys from its hashes under the current namespace."""
        chain.keys = self.keyspace.keys(chain.hashes)
        chain.rank_keys = self._ranked(chain.hashes)

    def _use(self, namespace: Namespace) -> None:
        engine = self._engine
        layers, heads, world = engine.num_layers, engine.total_kv_heads, engine.tp_size
        self.keyspace = Keyspace(namespace, Shard(0, layers, 0, heads))
        shards = [Shard.for_tp_rank(layers, heads, world, r, mla=self._mla) for r in range(world)]
        self._rank_keyspaces: tuple[Keyspace | HeadKeyspaces, ...] = tuple(
            HeadKeyspaces.for_shard(namespace, shard) if self._head_keys else Keyspace(namespace, shard)
            for shard in shards
        )

    def _ranked(self, hashes: Sequence[bytes]) -> tuple[tuple[ChunkKey, ...], ...]:
        if not self._shard_keys:
            return ()
        return tuple(zip(*(ks.keys(hashes) for ks in self._rank_keyspaces), strict=True))


def prompt_tokens(tokens: object, block_hashes: object, hash_block_tokens: object, num_tokens: object) -> int:
    """The prompt's length, from ``tokens`` or from ``num_tokens`` beside ``block_hashes``; raises
    ``InvalidSpecError`` naming the argument that does not fit."""
    if tokens is not None:
        return len(token_sequence(tokens))
    if block_hashes is None:
        raise InvalidSpecError("lookup needs tokens, or block_hashes with hash_block_tokens and num_tokens")
    hashes = _block_hashes(block_hashes)
    if not is_int_in(num_tokens, 0):
        raise InvalidSpecError(f"num_tokens: got {num_tokens!r}, expected an integer >= 0")
    if is_int_in(hash_block_tokens, 1) and num_tokens < len(hashes) * hash_block_tokens:
        raise InvalidSpecError(
            f"num_tokens: got {num_tokens}, but {len(hashes)} block hashes of {hash_block_tokens} tokens "
            "cover more"
        )
    return num_tokens


def token_sequence(tokens: object) -> Sequence[object]:
    """``tokens`` as the sequence it must be (each id is checked where it is hashed); raises
    ``InvalidSpecError`` naming ``tokens`` for anything else (a string, a number, a bool)."""
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
        raise InvalidSpecError(f"tokens: got {tokens!r}, expected a sequence of token ids")
    return tokens


def _block_hashes(block_hashes: object) -> Sequence[bytes]:
    if isinstance(block_hashes, str | bytes) or not isinstance(block_hashes, Sequence):
        raise InvalidSpecError(f"block_hashes: got {block_hashes!r}, expected a sequence of bytes")
    for position, value in enumerate(block_hashes):
        if not isinstance(value, bytes) or not value:
            raise InvalidSpecError(f"block_hashes[{position}]: got {value!r}, expected non-empty bytes")
    return block_hashes


def _hash_block_tokens(value: object) -> int:
    if not is_int_in(value, 1):
        raise InvalidSpecError(f"hash_block_tokens: got {value!r}, expected an integer >= 1")
    return value
