"""Naming KV: chained chunk hashes (``hashing``) and the keys that name a deployment, a shard and a chunk
(``keys``). It imports no other room: the model, the config and both sides name KV with it."""

from __future__ import annotations

from kvcore.keying.hashing import ChunkHasher, ExtraKeys, HashAlgorithm, MMSpan, PartialChunkPolicy
from kvcore.keying.keys import Keyspace, Namespace, Shard

__all__ = [
    "ChunkHasher",
    "ExtraKeys",
    "HashAlgorithm",
    "Keyspace",
    "MMSpan",
    "Namespace",
    "PartialChunkPolicy",
    "Shard",
]
