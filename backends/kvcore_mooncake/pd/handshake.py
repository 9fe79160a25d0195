"""Handshake rules: describe a rank on the wire, and decide whether two ranks can exchange KV.

Both sides run the same check: fingerprints must match field by field, then the core's ``plan_transfer``
must accept the two TP sides (heads divisible, HND for heterogeneous TP, same block geometry), and, for a
model with recurrent states, ``plan_state_transfer`` the two state sides. A refusal names every
difference, and it happens before any byte moves.
"""

from __future__ import annotations

from attrs import frozen

from kvcore.errors import IncompatibleLayoutError, InvalidSpecError
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.state_plan import StateLayout, StatePart, plan_state_transfer
from kvcore.model.transfer_plan import CopyColumns, TPSide, TransferPlan, plan_transfer
from kvcore_mooncake.pd.messages import PROTOCOL_VERSION, LayoutInfo, Pull, RankInfo
from kvcore_mooncake.pd.spec import RankSpec, state_beside

__all__ = ["PairPlan", "check_pair", "rank_info", "side_of", "state_of"]


@frozen
class PairPlan:
    """The plans between two engines: of their KV heads, and of their recurrent states where the model
    keeps them (``None`` otherwise). A pull names blocks of each apart (``Pull.state_src_blocks``)."""

    kv: TransferPlan
    state: TransferPlan | None = None

    def producers_for(self, consumer_rank: int, *, kv: bool = True, state: bool = False) -> frozenset[int]:
        """The producer ranks that write into ``consumer_rank`` for a pull of KV blocks (``kv``) and of
        state blocks (``state``)."""
        plans = [plan for plan, wanted in ((self.kv, kv), (self.state, state)) if wanted and plan is not None]
        return frozenset(p.producer_rank for plan in plans for p in plan.pairs_for_consumer(consumer_rank))

    def columns(self, producer_rank: int, pull: Pull) -> CopyColumns | None:
        """The copies ``producer_rank`` makes for ``pull`` within one layer's tensors (``None``: it holds
        nothing the pulling rank needs). Raises ``InvalidSpecError`` for blocks outside either side's
        layout, lists of different lengths, a destination named twice, or state blocks without states."""
        if (pull.state_src_blocks or pull.state_dst_blocks) and self.state is None:
            raise InvalidSpecError("state blocks named for a model without recurrent states")
        if set(pull.dst_blocks) & set(pull.state_dst_blocks):
            raise InvalidSpecError("a destination block is named for KV and for a state")
        found = False
        srcs: list[int] = []
        dsts: list[int] = []
        lengths: list[int] = []
        for plan, src_blocks, dst_blocks in (
            (self.kv, pull.src_blocks, pull.dst_blocks),
            (self.state, pull.state_src_blocks, pull.state_dst_blocks),
        ):
            if plan is None:
                continue
            for pair in plan.pairs_for_producer(producer_rank):
                if pair.consumer_rank != pull.tp_rank:
                    continue
                found = True
                columns = plan.materialize_columns(pair, src_blocks, dst_blocks)
                srcs += columns.src_offsets
                dsts += columns.dst_offsets
                lengths += columns.lengths
        return CopyColumns(tuple(srcs), tuple(dsts), tuple(lengths)) if found else None


def rank_info(spec: RankSpec, rpc_address: str, side_channel: str) -> RankInfo:
    layout = spec.layout
    return RankInfo(
        version=PROTOCOL_VERSION,
        engine_id=spec.engine_id,
        tp_size=spec.tp_size,
        tp_rank=spec.tp_rank,
        rpc_address=rpc_address,
        side_channel=side_channel,
        fingerprint=spec.fingerprint,
        layout=LayoutInfo(
            kind=layout.kind.value,
            num_blocks=layout.num_blocks,
            block_tokens=layout.block_tokens,
            num_kv_heads=layout.num_kv_heads,
            head_size=layout.head_size,
            dtype_size=layout.dtype_size,
            head_order=layout.head_order.value,
            packing=layout.packing,
            page_bytes=layout.page_bytes,
        ),
        layer_bases=spec.layer_bases,
    )


def state_of(info: RankInfo) -> StateLayout | None:
    """The peer's recurrent state, or ``None``. Raises ``InvalidSpecError`` for nonsense."""
    fingerprint = info.fingerprint
    if not fingerprint.state and not fingerprint.state_parts:
        return None
    try:
        return StateLayout(fingerprint.state, [StatePart(*part) for part in fingerprint.state_parts])
    except (ValueError, TypeError) as exc:
        raise InvalidSpecError(f"peer {info.engine_id} rank {info.tp_rank} sent a bad state: {exc}") from exc


def side_of(info: RankInfo) -> TPSide:
    """The peer's TP side. Raises ``InvalidSpecError`` (or ``IncompatibleLayoutError``) for nonsense."""
    raw = info.layout
    try:
        layout = KVLayout(
            LayoutKind(raw.kind),
            raw.num_blocks,
            raw.block_tokens,
            raw.num_kv_heads,
            raw.head_size,
            raw.dtype_size,
            HeadOrder(raw.head_order),
            raw.packing,
            raw.page_bytes,
        )
        if not 0 <= info.tp_rank < info.tp_size:
            raise InvalidSpecError(f"tp_rank {info.tp_rank} is outside [0, {info.tp_size})")
        if len(info.layer_bases) != info.fingerprint.num_layers:
            raise InvalidSpecError(
                f"{len(info.layer_bases)} layer bases for {info.fingerprint.num_layers} layers"
            )
        return TPSide(info.tp_size, layout, info.fingerprint.total_kv_heads, info.fingerprint.num_layers)
    except (ValueError, TypeError) as exc:  # enum values and attrs validators raise these
        raise InvalidSpecError(
            f"peer {info.engine_id} rank {info.tp_rank} sent a bad description: {exc}"
        ) from exc


def check_pair(producer: RankSpec | RankInfo, consumer: RankSpec | RankInfo) -> PairPlan:
    """The transfer plans between the two engines, or ``IncompatibleLayoutError`` naming each difference."""
    mine, theirs = producer.fingerprint, consumer.fingerprint
    for one in (producer, consumer):
        if isinstance(one, RankInfo) and one.version != PROTOCOL_VERSION:
            raise IncompatibleLayoutError(
                f"side-channel protocol version differs: got {one.version}, expected {PROTOCOL_VERSION}"
            )
    problems = [
        f"{name} differs: producer {getattr(mine, name)!r}, consumer {getattr(theirs, name)!r}"
        for name in mine.__struct_fields__
        if getattr(mine, name) != getattr(theirs, name)
    ]
    if problems:
        raise IncompatibleLayoutError("fingerprint mismatch: " + "; ".join(problems))
    producer_side, consumer_side = _side(producer), _side(consumer)
    kv = plan_transfer(producer_side, consumer_side)
    state = producer.state if isinstance(producer, RankSpec) else state_of(producer)
    if state is None:
        return PairPlan(kv)
    states = state_beside(state, producer_side), state_beside(state, consumer_side)
    return PairPlan(kv, plan_state_transfer(state, *states))


def _side(one: RankSpec | RankInfo) -> TPSide:
    return one.side if isinstance(one, RankSpec) else side_of(one)
