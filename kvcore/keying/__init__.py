"""Naming KV: chained chunk hashes (``hashing``), the keys that name a deployment, a shard and a chunk
(``keys``), and a request's keys as they grow (``request_keys``)."""

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
