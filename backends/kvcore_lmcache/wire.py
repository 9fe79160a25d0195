"""How kvcore names its chunks on an LMCache server, and how a chunk's bytes sit in a server slot.

An LMCache server does not take keys: it takes token ids and hashes them itself, chaining each chunk's
hash on the previous one. So a request's chunks go to the server as one token sequence, its *chain*:
each kvcore key becomes one chunk of token ids (the key's SHA-256 as eight 31-bit words, zero-padded to
the server's chunk size), and a range of that sequence names the chunks a request is about. A kvcore
key stands for its whole prefix, so a key always sits after the same chain and names one server entry;
a request's chunks then cost one round trip, not one per chunk.

A slot holds a header (magic, value length, key digest) before the value. A retrieve checks it, so a
slot of another client, a stale shared-memory mapping or a hash collision is a miss, never used.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from attrs import frozen
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

from kvcore.ids import ChunkKey

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

    def tokens(self, chain: Sequence[ChunkKey]) -> list[int]:
        """The token sequence of a chain: one server chunk per key."""
        padding = [0] * (self.chunk_tokens - _TOKEN_WORDS)
        out: list[int] = []
        for key in chain:
            digest = _digest(key)
            out.extend(int.from_bytes(digest[i : i + 4], "little") & 0x7FFFFFFF for i in range(0, 32, 4))
            out.extend(padding)
        return out

    def ipc_key(
        self, server_session: str, chain: Sequence[ChunkKey], start: int, end: int, worker: int | None
    ) -> IPCCacheServerKey:
        """The server key of chunks ``[start, end)`` of ``chain``; ``worker`` is ``None`` for lookups and
        lock releases, 0 for transfers."""
        return IPCCacheServerKey(
            model_name=self.model_name,
            world_size=1,
            worker_id=worker,
            token_ids=tuple(self.tokens(chain[:end])),
            start=start * self.chunk_tokens,
            end=end * self.chunk_tokens,
            request_id=server_session,
            num_kv_readers=1,
        )
