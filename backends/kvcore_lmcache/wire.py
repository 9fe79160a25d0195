"""How kvcore names its chunks on an LMCache server, and how a chunk's bytes sit in a server slot.

An LMCache server does not take keys: it takes token ids and hashes them itself, chaining each chunk's
hash on the previous one. kvcore's chunk keys already stand for a whole prefix, so each key becomes its
own one-chunk token sequence (the key's SHA-256, as 31-bit words, zero-padded to the server's chunk
size). Keys are then independent on the server: storing or looking up one never depends on which keys
were sent with it. Each (session, key) pair gets its own server session id, because a server session
caches the hashes of the first token sequence it saw.

A slot holds a header (magic, value length, key digest) before the value. A retrieve checks it, so a
slot of another client, a stale shared-memory mapping or a hash collision is a miss, never used.
"""

from __future__ import annotations

import hashlib
import struct

from attrs import frozen
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

from kvcore.ids import ChunkKey, RequestId

__all__ = ["HEADER_BYTES", "KeyCodec", "check_header", "header", "server_model_name"]

_TOKEN_WORDS = 8  # a SHA-256 digest as eight 32-bit words
_MAGIC = b"KVC1"
_FORBIDDEN = str.maketrans(dict.fromkeys("@/\\\x00", "_"))  # in server model names
_HEADER = struct.Struct("<4sI24s")
HEADER_BYTES = _HEADER.size
"""Bytes in front of every value in a slot."""


def server_model_name(model_name: str, slot_bytes: int) -> str:
    """The model name a client registers and keys under: the server keeps one layout per (model, world
    size), so the slot size is part of it. The server refuses ``@`` in model names (its storage tiers use
    it as a separator, and ``/`` as a path separator), so those characters become ``_``; two names
    that differ only there share a server namespace, which is harmless: token ids come from the full
    chunk key.
    """
    return f"{model_name.translate(_FORBIDDEN)}#{slot_bytes}"


def _digest(key: ChunkKey) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def header(key: ChunkKey, length: int) -> bytes:
    """The header written in front of ``length`` value bytes stored under ``key``."""
    return _HEADER.pack(_MAGIC, length, _digest(key)[:24])


def check_header(key: ChunkKey, length: int, raw: bytes) -> bool:
    """Whether ``raw`` is the header of a ``length``-byte value stored under ``key``."""
    return raw == header(key, length)


@frozen
class KeyCodec:
    """Renders server keys for one client: model name (with the layout), world size, chunk size."""

    model_name: str
    chunk_tokens: int

    def tokens(self, key: ChunkKey) -> tuple[int, ...]:
        digest = _digest(key)
        words = [int.from_bytes(digest[i : i + 4], "little") & 0x7FFFFFFF for i in range(0, 32, 4)]
        return (*words, *([0] * (self.chunk_tokens - _TOKEN_WORDS)))

    def server_session(self, session: RequestId, key: ChunkKey) -> str:
        """The server session of one key within one kvcore session."""
        return f"kvcore:{session}:{_digest(key)[:12].hex()}"

    def ipc_key(self, session: RequestId, key: ChunkKey, worker: int | None) -> IPCCacheServerKey:
        """The server key of one chunk; ``worker`` is ``None`` for lookups, 0 for transfers."""
        return IPCCacheServerKey(
            model_name=self.model_name,
            world_size=1,
            worker_id=worker,
            token_ids=self.tokens(key),
            start=0,
            end=self.chunk_tokens,
            request_id=self.server_session(session, key),
            num_kv_readers=1,
        )
