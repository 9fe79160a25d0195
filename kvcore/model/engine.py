"""What kvcore must know of the engine it serves: the model, the KV shape of one rank, the parallelism."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import Attribute, field, frozen
from attrs.validators import optional

from kvcore.checks import SIZE_LIMIT, int_in, is_int_in, positive_count, text
from kvcore.errors import ConfigError, InvalidSpecError, UnsupportedConfiguration
from kvcore.keying.keys import Shard
from kvcore.model.layout import KVLayout, LayoutKind

__all__ = ["KV_DTYPE_SIZES", "EngineSpec"]

KV_DTYPE_SIZES: Mapping[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}
"""The KV dtypes an engine may declare, by torch's name (``str(torch.bfloat16)`` without ``torch.``), and
their size in bytes. Aliases (``"half"``, ``"fp8"``, ``"auto"``) are refused: the name is part of every key,
so one dtype must have one spelling."""


def _known_dtype(instance: EngineSpec, attribute: Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or value not in KV_DTYPE_SIZES:
        raise InvalidSpecError(
            f"EngineSpec.kv_dtype: got {value!r}, expected one of {', '.join(KV_DTYPE_SIZES)}"
        )


def _a_layout(instance: EngineSpec, attribute: Attribute[Any], value: object) -> None:
    if not isinstance(value, KVLayout):
        raise InvalidSpecError(f"EngineSpec.layout: got {value!r}, expected a KVLayout")


@frozen
class EngineSpec:
    """One engine instance as kvcore sees it. ``layout`` describes one layer of one rank (all alike).

    The fields must agree, or ``InvalidSpecError`` names the disagreement: ``layout.dtype_size`` is the
    size of ``kv_dtype``; ``layout.num_kv_heads`` is what one of ``tp_size`` ranks holds of
    ``total_kv_heads`` by vLLM's rule (``total / tp`` heads, or one replicated head when there are fewer
    heads than ranks; MLA: one latent); the KV of every layer is at most ``2**62`` bytes. Counts are ints
    in ``[1, 2**62]``.

    A model whose layers keep KV of several kinds (vLLM's KV-cache groups: sliding-window and full
    attention layers) is one ``EngineSpec`` per group, each keyed apart (``model_id`` names the group).
    ``sibling_block_bytes`` is then what every other group of the engine takes in host memory for the
    tokens of one block of this one (groups may have blocks of different sizes): the groups share the
    backend's host memory, each with as many slots as the others (a prompt needs a chunk of each group),
    so the pool is sized over all of them (``kvcore.plugins.sizing.pool_slots``).

    ``window_tokens``: the layers attend to a sliding window of that many tokens (the next token's
    included), so a hit of ``H`` tokens needs only the KV of tokens ``[H - window_tokens + 1, H)``: the
    engine gives no block before them (``None`` in a load's block table), and the scheduler's lookup
    asks the pool only for the chunks of the hit's last window.

    A recurrent model's state (a ``state`` layout: vLLM's Mamba layers) is one block's window: a hit of
    ``H`` tokens needs only the state after token ``H``, in the block that ends there, so ``window_tokens``
    is the block size, chunks are one block each, and hits stop at chunk ends (``blocks_per_chunk``,
    ``kvcore.scheduling.scheduler``).
    """

    model_id: str = field(validator=text)
    kv_dtype: str = field(validator=_known_dtype)
    num_layers: int = field(validator=positive_count)
    total_kv_heads: int = field(validator=positive_count)
    layout: KVLayout = field(validator=_a_layout)
    tp_size: int = field(default=1, validator=positive_count)
    sibling_block_bytes: int = field(default=0, validator=int_in(0))
    window_tokens: int | None = field(default=None, validator=optional(positive_count))

    def __attrs_post_init__(self) -> None:
        layout = self.layout
        if layout.dtype_size != KV_DTYPE_SIZES[self.kv_dtype]:
            raise InvalidSpecError(
                f"EngineSpec: layout.dtype_size is {layout.dtype_size}, but kv_dtype {self.kv_dtype!r} "
                f"has {KV_DTYPE_SIZES[self.kv_dtype]}-byte elements"
            )
        # vLLM's head ownership (one rule with the keys'); rank 0 holds as many heads as every rank
        try:
            shard = Shard.for_tp_rank(
                self.num_layers, self.total_kv_heads, self.tp_size, 0, mla=layout.kind is LayoutKind.MLA
            )
        except UnsupportedConfiguration as exc:
            raise UnsupportedConfiguration(
                f"EngineSpec: total_kv_heads {self.total_kv_heads} and tp_size {self.tp_size}: {exc}"
            ) from None
        if layout.kind is LayoutKind.STATE and self.window_tokens != layout.block_tokens:
            raise InvalidSpecError(
                f"EngineSpec.window_tokens: got {self.window_tokens}, expected the block size "
                f"{layout.block_tokens} (a state layout: a hit needs only the state in the block it ends in)"
            )
        per_rank = shard.head_stop - shard.head_start
        if layout.num_kv_heads != per_rank:
            raise InvalidSpecError(
                f"EngineSpec: layout.num_kv_heads is {layout.num_kv_heads}, but total_kv_heads "
                f"{self.total_kv_heads} over tp_size {self.tp_size} gives {per_rank} head(s) per rank"
            )
        if self.num_layers * layout.nbytes > SIZE_LIMIT:
            raise InvalidSpecError(
                f"EngineSpec: num_layers {self.num_layers} x layout.nbytes {layout.nbytes} bytes, "
                "expected at most 2**62"
            )

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one engine block over every layer of one rank: one host block."""
        return self.num_layers * self.layout.block_bytes

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        """Engine blocks in one chunk of ``chunk_tokens`` tokens.

        Raises ``ConfigError`` for ``chunk_tokens`` that is not a positive multiple of the block size (a
        chunk of a fraction of a block has no host slot), before anything divides by it, and, for a
        ``state`` layout, for any other than the block size: the engine keeps a state only at the end of
        some blocks (where its computation stopped), so a chunk of several blocks would rarely have one.
        """
        block_tokens = self.layout.block_tokens
        if self.layout.kind is LayoutKind.STATE and chunk_tokens != block_tokens:
            raise ConfigError(
                "chunk_tokens",
                chunk_tokens,
                f"the engine's block size {block_tokens}: a recurrent state is kept per block",
            )
        if not is_int_in(chunk_tokens, 1, SIZE_LIMIT) or chunk_tokens % block_tokens:
            raise ConfigError(
                "chunk_tokens", chunk_tokens, f"a multiple of the engine's block size {block_tokens}"
            )
        return chunk_tokens // block_tokens
