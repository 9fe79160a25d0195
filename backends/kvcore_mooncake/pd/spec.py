"""``RankSpec``: what one rank of a prefill or decode engine brings to a transfer.

The composition root builds it from the engine (model name, KV dtype, TP size and rank, the layout
declared for its KV tensors and each layer tensor's address); producer and consumer derive from it their
``TPSide`` for the core's transfer plans, the memory they register, and the fingerprint they exchange.
"""

from __future__ import annotations

from attrs import field, frozen
from attrs.validators import ge, min_len

from kvcore.checks import int_ids, int_tuple
from kvcore.errors import InvalidSpecError
from kvcore.model.layout import KVLayout
from kvcore.model.transfer_plan import TPSide
from kvcore.ports import MemoryRegion
from kvcore_mooncake.pd.messages import Fingerprint

__all__ = ["RankSpec"]


def _in_tp(instance: RankSpec, attribute: object, value: int) -> None:
    if not 0 <= value < instance.tp_size:
        raise InvalidSpecError(f"tp_rank: got {value}, expected 0 <= tp_rank < tp_size={instance.tp_size}")


@frozen
class RankSpec:
    """One rank: ``layer_bases[i]`` is the address of layer ``i``'s KV tensor, laid out as ``layout``.

    Raises ``IncompatibleLayoutError`` when the heads cannot be split over ``tp_size`` ranks as vLLM does,
    ``InvalidSpecError`` for a rank outside the TP group or no layers.
    """

    engine_id: str
    model: str
    dtype: str
    tp_size: int = field(validator=ge(1))
    tp_rank: int = field(validator=_in_tp)
    total_kv_heads: int = field(validator=ge(1))
    layout: KVLayout
    layer_bases: tuple[int, ...] = field(converter=int_tuple, validator=[int_ids, min_len(1)])

    def __attrs_post_init__(self) -> None:
        self.side  # noqa: B018  # TPSide checks the head split; fail at construction, not at handshake

    @property
    def num_layers(self) -> int:
        return len(self.layer_bases)

    @property
    def side(self) -> TPSide:
        return TPSide(self.tp_size, self.layout, self.total_kv_heads, self.num_layers)

    @property
    def fingerprint(self) -> Fingerprint:
        layout = self.layout
        return Fingerprint(
            model=self.model,
            dtype=self.dtype,
            layout=layout.name,
            block_tokens=layout.block_tokens,
            total_kv_heads=self.total_kv_heads,
            head_size=layout.head_size,
            num_layers=self.num_layers,
        )

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        """The memory of every layer's blocks (what a transport registers): one region per layer, or one
        for all of them where layers interleave (cross-layer orders)."""
        spans: list[tuple[int, int]] = []
        for base in sorted(self.layer_bases):
            stop = base + self.layout.extent
            if spans and base < spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], stop))
            else:
                spans.append((base, stop))
        return tuple(MemoryRegion(start, stop - start) for start, stop in spans)
