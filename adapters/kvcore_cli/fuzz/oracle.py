"""The KV oracle of a fuzz run: the bytes every block of a request must hold, and where any bytes seen came
from, so that an error names them.

The engine "computes" KV deterministically: block ``j`` of a request holds a pure function of the engine's
epoch (a reset stands for a weight update, after which the same tokens have other KV), the request's salt
and its tokens up to the end of the block, or up to its last computed token. Poison and garbage are
derived from a description of them, and remembered by it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from kvcore.testing.memory import POISON
from kvcore_cli.fuzz.requests import BLOCK_TOKENS, Request, pack

__all__ = ["Bytes", "KVOracle", "fingerprint"]

Bytes = npt.NDArray[np.uint8]


def fingerprint(data: Bytes) -> bytes:
    return hashlib.blake2b(data.tobytes(), digest_size=16).digest()


class KVOracle:
    """The KV of any tokens, and the origin of the bytes seen, by fingerprint (``1 << 16`` at most: the
    first seen go first)."""

    def __init__(self, block_shape: tuple[int, ...]) -> None:
        """``block_shape`` is an engine block's ``[layer, head, token slot, bytes]``."""
        self._layers, self._heads, _, self._width = block_shape
        self._contents: dict[bytes, Bytes] = {}  # token slots by key: a memo
        self._origin: OrderedDict[bytes, str] = OrderedDict()
        self.known(np.zeros(block_shape, dtype=np.uint8), "zeros (never written)")
        self.known(np.full(block_shape, POISON, dtype=np.uint8), "the store's POISON (a failed fetch)")

    def slots(self, req: Request, j: int, upto: int) -> Bytes:
        """The KV of block ``j``'s tokens before ``upto``, ``[layer, head, slot, bytes]``: the KV of a
        token is a function of the epoch and of everything before it (its chain: salt and tokens)."""
        base = struct.pack("<I", req.epoch) + (req.hashes[j - 1] if j else req.chat.root)
        tokens = req.tokens[j * BLOCK_TOKENS : upto]
        key = hashlib.sha256(base + pack(tokens)).digest()
        slots = self._contents.get(key)
        if slots is None:
            if len(self._contents) >= 1 << 14:
                self._contents.clear()  # a memo: nothing else holds its keys
            size = self._layers * self._heads * self._width
            each = [hashlib.shake_128(base + pack(tokens[: t + 1])).digest(size) for t in range(len(tokens))]
            raw = np.frombuffer(b"".join(each), dtype=np.uint8).reshape(
                len(tokens), self._layers, self._heads, self._width
            )
            slots = self._contents[key] = raw.transpose(1, 2, 0, 3)
            self.known(
                slots, f"{req.rid} block {j} (tokens before {upto}, salt {req.chat.salt}, epoch {req.epoch})"
            )
        return slots

    def scribble(self, target: Bytes, why: str) -> None:
        """Fill ``target`` with bytes derived from ``why`` (poison, a failed copy's garbage), known by it."""
        data = np.frombuffer(hashlib.shake_128(why.encode()).digest(target.size), dtype=np.uint8)
        target[...] = data.reshape(target.shape)
        self.known(target, why)

    def known(self, data: Bytes, origin: str) -> None:
        """Bytes seen before keep their first origin."""
        key = fingerprint(data)
        if key not in self._origin:
            self._origin[key] = origin
            if len(self._origin) > 1 << 16:
                self._origin.popitem(last=False)

    def whose(self, block: Bytes) -> str:
        """Where a block's bytes came from, as far as known: the longest run of leading slots known."""
        for n in range(block.shape[2], 0, -1):
            origin = self._origin.get(fingerprint(block[:, :, :n]))
            if origin is not None:
                return origin if n == block.shape[2] else f"{origin} in its first {n} slots"
        return "bytes of unknown origin"
