"""What kvcore must know of the engine it serves: the model, the KV shape of one rank, the parallelism."""

from __future__ import annotations

from attrs import field, frozen
from attrs.validators import ge, min_len

from kvcore.layout import KVLayout

__all__ = ["EngineSpec"]


@frozen
class EngineSpec:
    """One engine instance as kvcore sees it. ``layout`` describes one layer of one rank (all alike)."""

    model_id: str = field(validator=min_len(1))
    kv_dtype: str = field(validator=min_len(1))
    num_layers: int = field(validator=ge(1))
    total_kv_heads: int = field(validator=ge(1))
    layout: KVLayout
    tp_size: int = field(default=1, validator=ge(1))

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one engine block over every layer of one rank: one host block."""
        return self.num_layers * self.layout.block_bytes
