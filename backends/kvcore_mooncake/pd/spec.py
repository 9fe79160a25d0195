"""``RankSpec``: what one rank of a prefill or decode engine brings to a transfer.

The composition root builds it from the engine (model name, KV dtype, TP size and rank, the layout
declared for its KV tensors and each layer tensor's address); producer and consumer derive from it their
``TPSide`` for the core's transfer plans, the memory they register, and the fingerprint they exchange.
"""

from __future__ import annotations

from attrs import field, frozen
from attrs.validators import ge, instance_of, min_len, optional

from kvcore.checks import int_ids, int_tuple
from kvcore.errors import InvalidSpecError
from kvcore.model.layout import KVLayout
from kvcore.model.state_plan import StateLayout
from kvcore.model.transfer_plan import TPSide
from kvcore.ports import MemoryRegion
from kvcore_mooncake.pd.messages import Fingerprint

__all__ = ["RankSpec", "state_beside"]


def _in_tp(instance: RankSpec, attribute: object, value: int) -> None:
    if not 0 <= value < instance.tp_size:
        raise InvalidSpecError(f"tp_rank: got {value}, expected 0 <= tp_rank < tp_size={instance.tp_size}")


@frozen
class RankSpec:
    """One rank: ``layer_bases[i]`` is the address of layer ``i``'s KV tensor, laid out as ``layout``.

    ``state``: the model also keeps recurrent states (a hybrid SSM model, whose attention and state layers
    share pages: ``layout`` is then the attention layer's K and V at the start of each page, the state its
    own bytes from the start of a page of the state groups' blocks, ``state_side``).

    Raises ``IncompatibleLayoutError`` when the heads (or the state's parts) cannot be split over
    ``tp_size`` ranks as vLLM does, ``InvalidSpecError`` for a rank outside the TP group or no layers.
    """

    engine_id: str
    model: str
    dtype: str
    tp_size: int = field(validator=ge(1))
    tp_rank: int = field(validator=_in_tp)
    total_kv_heads: int = field(validator=ge(1))
    layout: KVLayout
    layer_bases: tuple[int, ...] = field(converter=int_tuple, validator=[int_ids, min_len(1)])
    state: StateLayout | None = field(default=None, validator=optional(instance_of(StateLayout)))

    def __attrs_post_init__(self) -> None:
        # TPSide checks the head split (and the state's); fail at construction, not at handshake
        self.side  # noqa: B018
        self.state_side  # noqa: B018

    @property
    def num_layers(self) -> int:
        return len(self.layer_bases)

    @property
    def side(self) -> TPSide:
        return TPSide(self.tp_size, self.layout, self.total_kv_heads, self.num_layers)

    @property
    def state_side(self) -> TPSide | None:
        """The rank's recurrent state as a TP side, in the pages ``layout`` has (``state_beside``)."""
        return None if self.state is None else state_beside(self.state, self.side)

    @property
    def fingerprint(self) -> Fingerprint:
        layout, state = self.layout, self.state
        return Fingerprint(
            model=self.model,
            dtype=self.dtype,
            layout=layout.name,
            block_tokens=layout.block_tokens,
            total_kv_heads=self.total_kv_heads,
            head_size=layout.head_size,
            num_layers=self.num_layers,
            state="" if state is None else state.name,
            state_parts=() if state is None else tuple((p.units, p.unit_bytes) for p in state.parts),
        )

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        """The memory of every layer's blocks (what a transport registers): one region per layer, or one
        for all of them where layers interleave (cross-layer orders)."""
        spans: list[tuple[int, int]] = []
        state = self.state_side
        extent = max(self.layout.extent, 0 if state is None else state.layout.extent)
        for base in sorted(self.layer_bases):
            stop = base + extent
            if spans and base < spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], stop))
            else:
                spans.append((base, stop))
        return tuple(MemoryRegion(start, stop - start) for start, stop in spans)


def state_beside(state: StateLayout, kv: TPSide) -> TPSide:
    """``state`` as a TP side in the pages of ``kv``'s layout (a hybrid SSM model's layers share pages: a
    block of a state group holds a state where a block of an attention group holds K and V)."""
    layout = kv.layout
    return state.side(kv.tp_size, layout.num_blocks, layout.block_tokens, layout.block_stride, kv.num_layers)
