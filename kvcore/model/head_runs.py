"""Where each KV head of one rank lies in its host slots: the runs of bytes a value of one head is made of.

A tier that keeps one value per KV head (``kvcore.keying.keys.HeadKeyspaces``) serves engines at every
tensor-parallel size: each rank reads exactly the heads it holds, whoever wrote them. A rank's host block
is one engine block of every layer, layer after layer, each layer's segments (K then V, or one KV
segment) one after another (``EngineSpec.host_block_bytes``); in a heads-major segment (HND, vLLM CPU)
each head is one run, so a head's value is one run per segment, layer and block, taken in that order.
The value of head ``h`` is then the same bytes in the same order whichever rank holds it, alone or
beside others. Where tokens are the outer axis (NHD) a head is a run per token: a rank of several heads
then keeps one value per rank (``splits`` is false) and shares with engines of its own TP size only.
"""

from __future__ import annotations

from attrs import field, frozen

from kvcore.checks import SIZE_LIMIT, is_int_in, positive_count
from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey
from kvcore.keying.keys import head_keys
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import HeadOrder, KVLayout
from kvcore.ports import StoreItem

__all__ = ["HeadRuns", "Run", "splits"]

Run = tuple[int, int]
"""``(offset, length)`` in bytes."""


def splits(layout: KVLayout) -> bool:
    """Whether a rank's values can be one per KV head: it holds one head, or each head is one run of a
    segment (heads-major; the vLLM CPU layout always is)."""
    return layout.num_kv_heads == 1 or layout.head_order is HeadOrder.HND


@frozen
class HeadRuns:
    """The runs of each of a rank's ``heads`` inside one host block of ``block_bytes`` bytes."""

    block_bytes: int = field(validator=positive_count)
    runs: tuple[tuple[Run, ...], ...]
    _values: dict[tuple[int, int], tuple[Run, ...]] = field(init=False, factory=dict, eq=False, repr=False)

    @classmethod
    def of(cls, engine: EngineSpec) -> HeadRuns | None:
        """The runs of ``engine``'s rank, or ``None`` where its values cannot be one per head
        (``splits``)."""
        return cls.of_layout(engine.layout, engine.num_layers)

    @classmethod
    def of_layout(cls, layout: KVLayout, num_layers: int) -> HeadRuns | None:
        """The runs of a rank of ``num_layers`` layers of ``layout`` (``of``), for a block mover that
        knows the layout but not the engine's spec."""
        if not splits(layout):
            return None
        stride = layout.head_stride if layout.num_kv_heads > 1 else layout.segment_bytes
        per_layer = [
            [
                (segment * layout.segment_bytes + head * stride, stride)
                for segment in range(layout.segments_per_block)
            ]
            for head in range(layout.num_kv_heads)
        ]
        runs = tuple(
            tuple(
                (layer * layout.block_bytes + offset, length)
                for layer in range(num_layers)
                for offset, length in per_layer[head]
            )
            for head in range(layout.num_kv_heads)
        )
        return cls(num_layers * layout.block_bytes, runs)

    @property
    def heads(self) -> int:
        """The heads the rank holds."""
        return len(self.runs)

    @property
    def head_bytes(self) -> int:
        """Bytes of one head in one host block: a head's value over ``n`` blocks is ``n`` times it."""
        return sum(length for _, length in self.runs[0])

    def keys(self, what: str, key: ChunkKey) -> tuple[ChunkKey, ...]:
        """Each head's key in a rank's ``key`` (``kvcore.keying.keys.head_keys``); ``InvalidSpecError``
        naming ``what`` unless it joins one key per head."""
        parts = head_keys(key)
        if len(parts) != self.heads:
            raise InvalidSpecError(f"{what} ({key!r}): expected the keys of {self.heads} KV heads joined")
        return parts

    def split(self, what: str, item: StoreItem) -> tuple[StoreItem, ...]:
        """A rank's value of whole host blocks (``item``, under its heads' keys joined) as one value per
        head: the head's key, and its runs of those blocks. ``InvalidSpecError`` naming ``what`` for a
        key that joins another number of heads, or bytes that are not whole host blocks."""
        blocks, rest = divmod(item.length, self.block_bytes)
        if rest or not blocks:
            raise InvalidSpecError(
                f"{what} ({item.key!r}): {item.length} bytes, expected whole host blocks of "
                f"{self.block_bytes} bytes"
            )
        parts = []
        for head, key in enumerate(self.keys(what, item.key)):
            runs = self.value(head, item.offset, blocks)
            parts.append(StoreItem(key, runs[0][0], blocks * self.head_bytes, runs))
        return tuple(parts)

    def value(self, head: int, offset: int, blocks: int) -> tuple[Run, ...]:
        """The runs of local head ``head``'s value over ``blocks`` host blocks from byte ``offset`` (a
        slot, or a tail's leading blocks of it), in value order, runs that touch merged."""
        for name, value, low, high in (
            ("head", head, 0, self.heads - 1),
            ("offset", offset, 0, SIZE_LIMIT),
            ("blocks", blocks, 1, SIZE_LIMIT),
        ):
            if not is_int_in(value, low, high):
                raise InvalidSpecError(f"HeadRuns.value: {name} {value!r} is not an int in [{low}, {high}]")
        relative = self._values.get((head, blocks))
        if relative is None:  # a head's value over so many blocks, from byte 0: worked out once
            merged: list[list[int]] = []
            for block in range(blocks):
                for start, length in self.runs[head]:
                    start += block * self.block_bytes
                    if merged and merged[-1][0] + merged[-1][1] == start:
                        merged[-1][1] += length
                    else:
                        merged.append([start, length])
            relative = self._values[(head, blocks)] = tuple((start, length) for start, length in merged)
        return tuple((start + offset, length) for start, length in relative)
