"""Transfer plans for recurrent states (vLLM's Mamba layers) between engines of different TP sizes.

A state does not split over TP ranks by heads: each rank holds a slice of each of several parts (a Gated
DeltaNet layer's convolution state holds its Q, K and V channels one after another, then its recurrent
state holds its value heads), so a rank's bytes are its slice of the first part, then of the second, and
so on. ``StateLayout`` declares the parts over every rank (``StatePart``); ``plan_state_transfer`` pairs
each consumer rank with the producer ranks whose slices overlap its own and keeps, per pair, the copies
of one block as ``kvcore.model.transfer_plan`` does for heads, so that ``TransferPlan.materialize_columns``
turns them into a request's ranges unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from attrs import Attribute, field, frozen

from kvcore.checks import positive_count
from kvcore.errors import IncompatibleLayoutError, InvalidSpecError
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.transfer_plan import RangeCopy, RankPairPlan, TPSide, TransferPlan, merge_touching

__all__ = ["StateLayout", "StatePart", "plan_state_transfer"]

_NAME = re.compile(r"[a-z0-9_.-]{1,32}")


@frozen
class StatePart:
    """``units`` units of ``unit_bytes`` bytes over every rank together; rank ``r`` of ``T`` holds units
    ``[r * units / T, (r + 1) * units / T)``, one after another (a Q channel of every time step, a value
    head's recurrent state)."""

    units: int = field(validator=positive_count)
    unit_bytes: int = field(validator=positive_count)


def _name(instance: object, attribute: Attribute[Any], value: object) -> None:
    if not (isinstance(value, str) and _NAME.fullmatch(value)):
        raise InvalidSpecError(
            f"StateLayout.name: got {value!r}, expected 1 to 32 of a-z, 0-9, '_', '-', '.'"
        )


def _part_tuple(values: Iterable[StatePart]) -> tuple[StatePart, ...]:
    try:
        return tuple(values)
    except TypeError:
        raise InvalidSpecError(f"StateLayout.parts: got {values!r}, expected one StatePart or more") from None


def _parts(instance: object, attribute: Attribute[Any], value: tuple[object, ...]) -> None:
    if not value or not all(isinstance(part, StatePart) for part in value):
        raise InvalidSpecError(f"StateLayout.parts: got {value!r}, expected one StatePart or more")


@frozen
class StateLayout:
    """How one recurrent state splits over TP ranks: a rank's state is its slice of each of ``parts``, in
    order, from the first byte of its block (the page where a state layer keeps it).

    ``name`` says what the bytes are (the state's kind, its shapes over every rank, dtypes and memory
    order) and is the same at every TP size: two engines exchange states only under one name.
    """

    name: str = field(validator=_name)
    parts: tuple[StatePart, ...] = field(converter=_part_tuple, validator=_parts)

    def rank_bytes(self, tp_size: int) -> int:
        """The bytes of one rank's state at ``tp_size`` ranks. Raises ``IncompatibleLayoutError`` naming the
        first part whose units the ranks cannot share evenly."""
        for index, part in enumerate(self.parts):
            if part.units % tp_size:
                raise IncompatibleLayoutError(
                    f"state {self.name}: part {index} has {part.units} units, which {tp_size} ranks cannot "
                    "share evenly"
                )
        return sum(part.units // tp_size * part.unit_bytes for part in self.parts)

    def side(
        self, tp_size: int, num_blocks: int, block_tokens: int, page_bytes: int, num_layers: int
    ) -> TPSide:
        """A rank's state at ``tp_size`` ranks as a TP side: one ``state`` layout of its bytes in pages of
        ``page_bytes``, one "head" per rank (its slice). Raises ``IncompatibleLayoutError`` as
        ``rank_bytes``, ``InvalidSpecError`` where a page cannot hold the state."""
        state = self.rank_bytes(tp_size)
        layout = KVLayout(
            LayoutKind.STATE,
            num_blocks,
            block_tokens,
            1,
            state,
            1,
            packing=self.name,
            page_bytes=None if page_bytes == state else page_bytes,
        )
        return TPSide(tp_size, layout, tp_size, num_layers)

    def slices(self, tp_size: int, rank: int) -> Iterator[tuple[StatePart, int, int, int]]:
        """(part, offset of ``rank``'s slice in its state, first unit, stop unit) of every part, at
        ``tp_size`` ranks (whose units divide evenly: ``rank_bytes`` checks)."""
        offset = 0
        for part in self.parts:
            share = part.units // tp_size
            yield part, offset, rank * share, (rank + 1) * share
            offset += share * part.unit_bytes


def plan_state_transfer(state: StateLayout, producer: TPSide, consumer: TPSide) -> TransferPlan:
    """Pair every consumer rank with the producer ranks whose slices of ``state`` overlap its own, with the
    copies of one block each (the overlaps, part by part, merged where they touch).

    ``producer`` and ``consumer`` are ``state.side`` of each engine. Raises ``IncompatibleLayoutError``
    naming every difference that makes the exchange impossible (another state, block size or layer count,
    a TP size that cannot split a part).
    """
    problems = []
    for role, side in (("producer", producer), ("consumer", consumer)):
        layout = side.layout
        try:
            expected = state.rank_bytes(side.tp_size)
        except IncompatibleLayoutError as exc:
            problems.append(f"{role}: {exc}")
            continue
        if (
            layout.kind is not LayoutKind.STATE
            or layout.packing != state.name
            or layout.head_size != expected
        ):
            problems.append(
                f"the {role}'s layout ({layout.name}, {layout.head_size} bytes) is not state {state.name} at "
                f"TP {side.tp_size} ({expected} bytes)"
            )
    if producer.layout.block_tokens != consumer.layout.block_tokens:
        problems.append(
            f"block_tokens differs: producer {producer.layout.block_tokens}, "
            f"consumer {consumer.layout.block_tokens}"
        )
    if producer.num_layers != consumer.num_layers:
        problems.append(f"num_layers differs: producer {producer.num_layers}, consumer {consumer.num_layers}")
    if problems:
        raise IncompatibleLayoutError("cannot transfer states: " + "; ".join(problems))
    pairs = []
    for consumer_rank in range(consumer.tp_size):
        for producer_rank in range(producer.tp_size):
            copies = _overlaps(state, producer.tp_size, producer_rank, consumer.tp_size, consumer_rank)
            if copies:
                pairs.append(
                    RankPairPlan(producer_rank, consumer_rank, producer_rank, producer_rank + 1, copies)
                )
    return TransferPlan(producer, consumer, tuple(pairs))


def _overlaps(
    state: StateLayout, producer_tp: int, producer_rank: int, consumer_tp: int, consumer_rank: int
) -> tuple[RangeCopy, ...]:
    copies = []
    for (part, src, src_first, src_stop), (_, dst, dst_first, dst_stop) in zip(
        state.slices(producer_tp, producer_rank), state.slices(consumer_tp, consumer_rank), strict=True
    ):
        first, stop = max(src_first, dst_first), min(src_stop, dst_stop)
        if first < stop:
            copies.append(
                RangeCopy(
                    src + (first - src_first) * part.unit_bytes,
                    dst + (first - dst_first) * part.unit_bytes,
                    (stop - first) * part.unit_bytes,
                )
            )
    return merge_touching(copies) if copies else ()
