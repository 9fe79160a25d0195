"""Transfer plans for prefill/decode: which byte ranges go from which producer rank to which consumer rank.

The producer (prefill) runs with tensor parallelism P, the consumer (decode) with D; each rank holds a
slice of the KV heads by vLLM's rule. ``plan_transfer`` checks up front that the two sides can exchange KV
and pairs every consumer rank with the producer ranks holding its heads, reading one replica where heads
are replicated. Per pair it keeps a template: the copies of one block, relative to block 0 of one layer.
Every layer shares the layout and every block sits ``block_stride`` further, so ``materialize`` turns the
template into concrete ranges for a request's block ids with arithmetic alone, merging ranges that touch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise

from attrs import field, frozen
from attrs.validators import ge

from kvcore.errors import IncompatibleLayoutError, InvalidSpecError
from kvcore.model.layout import ByteRange, HeadOrder, KVLayout, LayoutKind

__all__ = ["CopyColumns", "RangeCopy", "RankPairPlan", "TPSide", "TransferPlan", "plan_transfer"]

# FlashAttention and FlashInfer keep each block's K and V segments in the same byte order; only where the
# segments sit differs, so the two exchange KV segment by segment.
_SEGMENT_COMPATIBLE = frozenset({LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER})


@frozen
class TPSide:
    """One side of a transfer: its TP size, the per-rank layout of each layer, and the model's KV heads.

    Raises ``IncompatibleLayoutError`` when the heads cannot be split over the ranks by vLLM's rule (each
    rank holds ``total_kv_heads / tp_size`` heads, or one head replicated over ``tp_size /
    total_kv_heads`` ranks) or when the layout holds a different number of heads per rank.
    """

    tp_size: int = field(validator=ge(1))
    layout: KVLayout
    total_kv_heads: int = field(validator=ge(1))
    num_layers: int = field(validator=ge(1))

    def __attrs_post_init__(self) -> None:
        heads, tp = self.total_kv_heads, self.tp_size
        if self.layout.kind is LayoutKind.MLA and heads != 1:
            raise IncompatibleLayoutError(
                f"an MLA model has one latent KV head per layer, got total_kv_heads={heads}"
            )
        if heads % tp and tp % heads:
            raise IncompatibleLayoutError(
                f"total_kv_heads={heads} and tp_size={tp}: neither divides the other, so ranks cannot hold "
                "whole heads"
            )
        if self.layout.num_kv_heads != self.heads_per_rank:
            raise IncompatibleLayoutError(
                f"total_kv_heads={heads} over tp_size={tp} gives {self.heads_per_rank} heads per rank, "
                f"but the layout holds num_kv_heads={self.layout.num_kv_heads}"
            )

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.total_kv_heads // self.tp_size)

    def heads_of(self, rank: int) -> tuple[int, int]:
        """The global KV heads ``[start, stop)`` that ``rank`` holds."""
        if not 0 <= rank < self.tp_size:
            raise InvalidSpecError(f"rank {rank} is outside [0, {self.tp_size})")
        if self.total_kv_heads >= self.tp_size:
            return rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank
        head = rank // (self.tp_size // self.total_kv_heads)
        return head, head + 1


@frozen
class RangeCopy:
    """Copy ``length`` bytes from ``src_offset`` in a producer tensor to ``dst_offset`` in a consumer one."""

    src_offset: int
    dst_offset: int
    length: int


@frozen
class RankPairPlan:
    """What one producer rank sends one consumer rank: global heads ``[head_start, head_stop)`` (of a
    recurrent state's plan, ``kvcore.model.state_plan``: the producer rank's slice, its one "head").

    ``block_copies`` holds the copies of block 0 of one layer; block ``b`` is the same shifted by each
    side's ``block_stride``.
    """

    producer_rank: int
    consumer_rank: int
    head_start: int
    head_stop: int
    block_copies: tuple[RangeCopy, ...]


def _same_lengths(instance: CopyColumns, attribute: object, value: tuple[int, ...]) -> None:
    if not len(instance.src_offsets) == len(instance.dst_offsets) == len(value):
        raise InvalidSpecError("src_offsets, dst_offsets and lengths must have the same length")


@frozen
class CopyColumns:
    """Byte copies within one layer's tensors as parallel columns, the form batched copy APIs take.

    The caller adds each layer's base address to the offsets.
    """

    src_offsets: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    lengths: tuple[int, ...] = field(validator=_same_lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[RangeCopy]:
        return map(RangeCopy, self.src_offsets, self.dst_offsets, self.lengths)


@frozen
class TransferPlan:
    """The validated pairing of a producer side with a consumer side; build it with ``plan_transfer``."""

    producer: TPSide
    consumer: TPSide
    pairs: tuple[RankPairPlan, ...]

    @property
    def num_layers(self) -> int:
        return self.producer.num_layers

    def pairs_for_consumer(self, consumer_rank: int) -> tuple[RankPairPlan, ...]:
        """The producer ranks (and their copies) that together fill ``consumer_rank``'s heads."""
        self.consumer.heads_of(consumer_rank)
        return tuple(pair for pair in self.pairs if pair.consumer_rank == consumer_rank)

    def pairs_for_producer(self, producer_rank: int) -> tuple[RankPairPlan, ...]:
        """The consumer ranks that ``producer_rank`` sends to; empty for an unused replica."""
        self.producer.heads_of(producer_rank)
        return tuple(pair for pair in self.pairs if pair.producer_rank == producer_rank)

    def materialize(
        self, pair: RankPairPlan, src_blocks: Sequence[int], dst_blocks: Sequence[int]
    ) -> tuple[RangeCopy, ...]:
        """``materialize_columns`` as one ``RangeCopy`` per range."""
        return tuple(self.materialize_columns(pair, src_blocks, dst_blocks))

    def materialize_columns(
        self, pair: RankPairPlan, src_blocks: Sequence[int], dst_blocks: Sequence[int]
    ) -> CopyColumns:
        """The copies that move producer block ``src_blocks[i]`` into consumer block ``dst_blocks[i]``.

        Offsets are within one layer's tensor, the same for every layer. Ranges that touch on both sides
        are merged: consecutive block ids on both sides become one run wherever the pair copies whole
        segments. Raises ``InvalidSpecError`` for a pair of another plan, block lists of different lengths,
        a block id outside a layout, or a consumer block named twice.
        """
        self._check_blocks(pair, src_blocks, dst_blocks)
        src_stride = self.producer.layout.block_stride
        dst_stride = self.consumer.layout.block_stride
        srcs: list[int] = []
        dsts: list[int] = []
        lengths: list[int] = []
        runs: _BlockRuns | None = None
        for copy in pair.block_copies:
            src, dst, length = copy.src_offset, copy.dst_offset, copy.length
            if length == src_stride == dst_stride:
                if runs is None:
                    runs = _BlockRuns.of(src_blocks, dst_blocks)
                srcs.extend([src + block * src_stride for block in runs.src_firsts])
                dsts.extend([dst + block * dst_stride for block in runs.dst_firsts])
                lengths.extend([count * length for count in runs.counts])
            else:
                srcs.extend([src + block * src_stride for block in src_blocks])
                dsts.extend([dst + block * dst_stride for block in dst_blocks])
                lengths.extend([length] * len(src_blocks))
        return CopyColumns(tuple(srcs), tuple(dsts), tuple(lengths))

    def _check_blocks(self, pair: RankPairPlan, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        if pair not in self.pairs:
            raise InvalidSpecError(
                f"pair {pair.producer_rank}->{pair.consumer_rank} does not belong to this transfer plan"
            )
        if len(src_blocks) != len(dst_blocks):
            raise InvalidSpecError(
                f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks"
            )
        if not src_blocks:
            return
        for name, blocks, layout in (
            ("source", src_blocks, self.producer.layout),
            ("destination", dst_blocks, self.consumer.layout),
        ):
            low, high = min(blocks), max(blocks)
            if low < 0 or high >= layout.num_blocks:
                bad = low if low < 0 else high
                raise InvalidSpecError(f"{name} block {bad} is outside [0, {layout.num_blocks})")
        if len(set(dst_blocks)) != len(dst_blocks):
            raise InvalidSpecError("a destination block appears twice: two copies would write it")


def plan_transfer(producer: TPSide, consumer: TPSide) -> TransferPlan:
    """Pair every consumer rank with the producer ranks that hold its heads, with one block's copies each.

    Replicated producer heads are read from one replica, chosen by consumer rank so that consumers sharing
    a head spread over its replicas; for MLA consumer rank ``c`` reads producer rank ``c % P``. Raises
    ``IncompatibleLayoutError`` naming every difference that makes the exchange impossible.
    """
    _check_compatible(producer, consumer)
    pairs = []
    for consumer_rank in range(consumer.tp_size):
        for producer_rank, head_start, head_stop in _sources(producer, consumer, consumer_rank):
            src = _local_runs(producer, producer_rank, head_start, head_stop)
            dst = _local_runs(consumer, consumer_rank, head_start, head_stop)
            copies = merge_touching(_zip_runs(src, dst))
            pairs.append(RankPairPlan(producer_rank, consumer_rank, head_start, head_stop, copies))
    return TransferPlan(producer, consumer, tuple(pairs))


def _check_compatible(producer: TPSide, consumer: TPSide) -> None:
    src, dst = producer.layout, consumer.layout
    problems = []
    if (src.kind is LayoutKind.MLA) != (dst.kind is LayoutKind.MLA):
        problems.append(
            f"MLA and non-MLA KV cannot be exchanged (producer {src.kind.value}, consumer {dst.kind.value})"
        )
    elif src.kind is not dst.kind and not {src.kind, dst.kind} <= _SEGMENT_COMPATIBLE:
        problems.append(f"layout kind differs: producer {src.kind.value}, consumer {dst.kind.value}")
    elif src.kind is not LayoutKind.MLA and src.head_order is not dst.head_order:
        problems.append(
            f"head order differs: producer {src.head_order.value}, consumer {dst.head_order.value}"
        )
    for name in ("packing", "block_tokens", "head_size", "dtype_size"):
        if getattr(src, name) != getattr(dst, name):
            problems.append(f"{name} differs: producer {getattr(src, name)}, consumer {getattr(dst, name)}")
    for name in ("total_kv_heads", "num_layers"):
        if getattr(producer, name) != getattr(consumer, name):
            problems.append(
                f"{name} differs: producer {getattr(producer, name)}, consumer {getattr(consumer, name)}"
            )
    if (
        not problems
        and src.head_order is HeadOrder.NHD
        and src.kind is not LayoutKind.MLA
        and producer.heads_per_rank != consumer.heads_per_rank
    ):
        problems.append(
            f"heterogeneous TP needs the HND layout: with NHD, producer ranks (TP {producer.tp_size}) hold "
            f"{producer.heads_per_rank} heads and consumer ranks (TP {consumer.tp_size}) "
            f"{consumer.heads_per_rank}, so every block would split into one "
            f"{min(producer.heads_per_rank, consumer.heads_per_rank) * src.head_stride}-byte run per token"
        )
    if problems:
        raise IncompatibleLayoutError("cannot transfer KV: " + "; ".join(problems))


def _sources(producer: TPSide, consumer: TPSide, consumer_rank: int) -> list[tuple[int, int, int]]:
    """(producer rank, global head start, stop) for each producer rank the consumer rank reads from."""
    start, stop = consumer.heads_of(consumer_rank)
    if producer.total_kv_heads >= producer.tp_size:
        per = producer.heads_per_rank
        return [
            (rank, max(start, rank * per), min(stop, (rank + 1) * per))
            for rank in range(start // per, (stop - 1) // per + 1)
        ]
    replicas = producer.tp_size // producer.total_kv_heads
    return [(head * replicas + consumer_rank % replicas, head, head + 1) for head in range(start, stop)]


def _local_runs(side: TPSide, rank: int, head_start: int, head_stop: int) -> tuple[ByteRange, ...]:
    first, _ = side.heads_of(rank)
    return side.layout.head_runs(0, head_start - first, head_stop - first)


def _zip_runs(src: Sequence[ByteRange], dst: Sequence[ByteRange]) -> list[RangeCopy]:
    """Pair two byte streams holding the same data in the same order, cutting where either run ends."""
    copies = []
    i = j = 0
    src_at, dst_at = src[0].offset, dst[0].offset
    while i < len(src) and j < len(dst):
        length = min(src[i].stop - src_at, dst[j].stop - dst_at)
        copies.append(RangeCopy(src_at, dst_at, length))
        src_at += length
        dst_at += length
        if src_at == src[i].stop:
            i += 1
            if i < len(src):
                src_at = src[i].offset
        if dst_at == dst[j].stop:
            j += 1
            if j < len(dst):
                dst_at = dst[j].offset
    return copies


def merge_touching(copies: Sequence[RangeCopy]) -> tuple[RangeCopy, ...]:
    """``copies`` (at least one) with each copy that continues the previous one on both sides joined to it."""
    merged = [copies[0]]
    for copy in copies[1:]:
        last = merged[-1]
        if (
            last.src_offset + last.length == copy.src_offset
            and last.dst_offset + last.length == copy.dst_offset
        ):
            merged[-1] = RangeCopy(last.src_offset, last.dst_offset, last.length + copy.length)
        else:
            merged.append(copy)
    return tuple(merged)


@frozen
class _BlockRuns:
    """Block ids cut into runs that go up by one on both sides: first ids and lengths of each run."""

    src_firsts: Sequence[int]
    dst_firsts: Sequence[int]
    counts: list[int]

    @classmethod
    def of(cls, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> _BlockRuns:
        breaks = [
            i
            for i, ((src_before, dst_before), (src, dst)) in enumerate(
                pairwise(zip(src_blocks, dst_blocks, strict=True)), 1
            )
            if src - src_before != 1 or dst - dst_before != 1
        ]
        if len(breaks) + 1 >= len(src_blocks):  # nothing merges (or nothing to copy)
            return cls(src_blocks, dst_blocks, [1] * len(src_blocks))
        starts = [0, *breaks]
        ends = [*starts[1:], len(src_blocks)]
        return cls(
            [src_blocks[i] for i in starts],
            [dst_blocks[i] for i in starts],
            [end - start for start, end in zip(starts, ends, strict=True)],
        )
