"""Handshake rules: describe a rank on the wire, and decide whether two ranks can exchange KV.

Both sides run the same check: fingerprints must match field by field, then the core's ``plan_transfer``
must accept the two TP sides (heads divisible, HND for heterogeneous TP, same block geometry). A refusal
names every difference, and it happens before any byte moves.
"""

from __future__ import annotations

from kvcore.errors import IncompatibleLayoutError, InvalidSpecError
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.transfer_plan import TPSide, TransferPlan, plan_transfer
from kvcore_mooncake.pd.messages import PROTOCOL_VERSION, LayoutInfo, RankInfo
from kvcore_mooncake.pd.spec import RankSpec

__all__ = ["check_pair", "rank_info", "side_of"]


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


def check_pair(producer: RankSpec | RankInfo, consumer: RankSpec | RankInfo) -> TransferPlan:
    """The transfer plan between the two engines, or ``IncompatibleLayoutError`` naming each difference."""
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
    return plan_transfer(_side(producer), _side(consumer))


def _side(one: RankSpec | RankInfo) -> TPSide:
    return one.side if isinstance(one, RankSpec) else side_of(one)
