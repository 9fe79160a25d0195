"""Out-of-band access to the server's entries for kvcore keys, through LMCache's raw request client.

The conformance harness peeks and pokes with this, bypassing ``LMCacheManagedTier``: its own
registration, its own mapping of the shared-memory pool, its own requests.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

from kvcore.ids import ChunkKey
from kvcore_lmcache.link import SlotLayout, register_slots
from kvcore_lmcache.wire import HEADER_BYTES, KeyCodec, check_header, header, server_model_name

TIMEOUT_S = 5.0


class RawClient:
    """Stores and reads kvcore-shaped entries (header + value) the way the backend lays them out; ``align``
    as the tier's ``block_bytes`` (``SlotLayout``)."""

    def __init__(
        self, url: str, model_name: str, value_bytes: int, chunk_tokens: int, align: int = 1
    ) -> None:
        self.layout = SlotLayout(value_bytes, align)
        self.slot_bytes = self.layout.slot_bytes
        self.codec = KeyCodec(server_model_name(model_name, self.slot_bytes), chunk_tokens)
        self.client = RequestClientFactory.create(url)
        self.instance_id = uuid.uuid4().int & ((1 << 62) - 1)
        self.segment = register_slots(
            url,
            self.client,
            self.instance_id,
            self.codec.model_name,
            chunk_tokens,
            self.slot_bytes,
            TIMEOUT_S,
        )
        self._map = self.segment.view

    def _server(self) -> str:
        return f"raw:{self.instance_id:x}:{uuid.uuid4().hex[:12]}"

    def poke(self, key: ChunkKey, value: bytes, preceding: Sequence[ChunkKey] = ()) -> None:
        server, chain = self._server(), (*preceding, key)
        ipc_key = self.codec.ipc_key(server, chain, len(preceding), len(chain), 0)
        reply = self.client.prepare_store(ipc_key, self.instance_id).result(timeout=TIMEOUT_S)
        slots = reply.context.get("slots")
        if slots:
            offset = int(slots[0]["offset"])
            at = self.layout.value_offset(offset)
            self._map[at : at + len(value)] = value
            self._map[offset : offset + HEADER_BYTES] = header(key, len(value))
            assert self.client.commit_store(ipc_key, self.instance_id, b"").result(timeout=TIMEOUT_S)
        self.client.end_session(server).result(timeout=TIMEOUT_S)

    def peek(self, key: ChunkKey, preceding: Sequence[ChunkKey] = ()) -> bytes | None:
        """The value stored under ``key`` after ``preceding`` (the lookup locks nothing else for long:
        a preceding chunk the server lacks is a miss, as for the tier)."""
        server, chain = self._server(), (*preceding, key)
        self.client.lookup(self.codec.ipc_key(server, chain, 0, len(chain), None), 1).result(
            timeout=TIMEOUT_S
        )
        deadline = time.monotonic() + TIMEOUT_S
        while (hits := self.client.query_prefetch_status(server).result(timeout=TIMEOUT_S)) is None:
            assert time.monotonic() < deadline, "prefetch never finished"
        value = None
        if hits == len(chain):
            ipc_key = self.codec.ipc_key(server, chain, len(preceding), len(chain), 0)
            reply = self.client.prepare_retrieve(ipc_key, self.instance_id).result(timeout=TIMEOUT_S)
            slots = reply.context.get("slots") if reply.success else None
            if slots:
                offset = int(slots[0]["offset"])
                raw = bytes(self._map[offset : offset + HEADER_BYTES])
                length = int.from_bytes(raw[4:8], "little")
                at = self.layout.value_offset(offset)
                if check_header(key, length, raw):
                    value = bytes(self._map[at : at + length])
            self.client.commit_retrieve(ipc_key, self.instance_id).result(timeout=TIMEOUT_S)
        if hits:
            lock_key = self.codec.ipc_key(server, chain, 0, min(hits, len(preceding)), None)
            self.client.free_lookup_locks(lock_key, 1).result(timeout=TIMEOUT_S)
        self.client.end_session(server).result(timeout=TIMEOUT_S)
        return value

    def lock(self, chain: Sequence[ChunkKey]) -> str:
        """Read-lock the chunks of ``chain`` the server holds, as a lookup does, in a server session of
        its own, which is returned (``unlock`` releases them)."""
        server = self._server()
        self.client.lookup(self.codec.ipc_key(server, chain, 0, len(chain), None), 1).result(
            timeout=TIMEOUT_S
        )
        deadline = time.monotonic() + TIMEOUT_S
        while self.client.query_prefetch_status(server).result(timeout=TIMEOUT_S) is None:
            assert time.monotonic() < deadline, "prefetch never finished"
        return server

    def unlock(self, server: str, chain: Sequence[ChunkKey]) -> None:
        lock_key = self.codec.ipc_key(server, chain, 0, len(chain), None)
        self.client.free_lookup_locks(lock_key, 1).result(timeout=TIMEOUT_S)
        self.client.end_session(server).result(timeout=TIMEOUT_S)

    def close(self) -> None:
        self.client.unregister_kv_cache_engine_driven_context(self.instance_id).result(timeout=TIMEOUT_S)
        self.segment.close()
        self.client.close()
