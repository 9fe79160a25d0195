"""How much host memory a config buys: bytes per slot, slots per rank, and whether they stage a step.

A slot holds one chunk of one rank's shard, every layer. A backend's ``host_bytes`` is the total across
the ranks of one engine (as vLLM's own offloading size is), so each rank gets ``host_bytes / tp_size``
bytes, in whole slots. Pure arithmetic on the config and the engine: both sides compute the same.
"""

from __future__ import annotations

from kvcore.checks import SIZE_LIMIT, is_int_in
from kvcore.config.model import KVCoreConfig
from kvcore.config.tiers import TierStack
from kvcore.errors import ConfigError
from kvcore.kit.settings import keeps_heads
from kvcore.model.engine import EngineSpec
from kvcore.model.head_runs import splits

__all__ = ["check_world", "host_field", "keeps_head_values", "pool_slots", "slot_bytes", "staging_shortfall"]


def slot_bytes(config: KVCoreConfig, engine: EngineSpec) -> int:
    """Bytes of one host slot: one chunk of one rank's shard, every layer. Raises ``ConfigError`` when
    ``chunk_tokens`` is not a multiple of the engine's block size."""
    return engine.blocks_per_chunk(config.chunk_tokens) * engine.host_block_bytes


def keeps_head_values(tier: KVCoreConfig, engine: EngineSpec) -> bool:
    """Whether the remote tier ``tier`` (a config whose ``backend`` is one tier's settings) keeps a value
    per KV head for ``engine``: its backend says so (``PER_HEAD``) and the engine's heads can be cut
    apart (``kvcore.model.head_runs.splits``). Both sides, and the backend itself, ask this: a value is
    then one head's part of a slot."""
    return keeps_heads(tier.backend) and splits(engine.layout)


def _group_slots_bytes(config: KVCoreConfig, engine: EngineSpec) -> int:
    """Bytes of host memory one slot takes with those of every other KV-cache group of the engine
    (``EngineSpec.sibling_block_bytes``): the groups share the pool, each with as many slots."""
    siblings = engine.blocks_per_chunk(config.chunk_tokens) * engine.sibling_block_bytes
    return slot_bytes(config, engine) + siblings


def pool_slots(config: KVCoreConfig, engine: EngineSpec, world_size: int = 1) -> int:
    """Host slots that the backend's host memory buys per rank (``size`` for the CPU tier, ``local_size``
    in front of a remote tier); for one KV-cache group of a hybrid model, the slots of every group
    (``EngineSpec.sibling_block_bytes``) share that memory, each group as many. 0 for a backend that
    moves blocks straight to its own memory and was given no host memory (``MOVES_BLOCKS``).

    Raises ``ConfigError`` for a ``world_size`` other than the engine's ``tp_size``, a ``chunk_tokens``
    that is not a multiple of the block size, or a size below one slot on each rank.
    """
    check_world(engine, world_size)
    one = _group_slots_bytes(config, engine)
    backend = config.backend
    if backend.MOVES_BLOCKS and backend.host_bytes == 0:
        return 0
    slots = backend.host_bytes // world_size // one
    if slots < 1:
        groups = " of every KV-cache group" if engine.sibling_block_bytes else ""
        raise ConfigError(
            host_field(config),
            backend.host_bytes,
            f"at least {one * world_size} bytes: one chunk of {config.chunk_tokens} tokens{groups} "
            f"({one} bytes) on each of {world_size} rank(s)",
        )
    return slots


def check_world(engine: EngineSpec, world_size: int) -> None:
    """The ranks of one engine are its tensor-parallel ranks: host memory is split among exactly those.
    Raises ``ConfigError`` naming ``world_size`` otherwise."""
    if not is_int_in(world_size, 1, SIZE_LIMIT) or world_size != engine.tp_size:
        raise ConfigError("world_size", world_size, f"the engine's tp_size {engine.tp_size}")


def staging_shortfall(config: KVCoreConfig, engine: EngineSpec, step_tokens: int) -> str | None:
    """Why the local pool is too small to stage one step's saves to a remote tier, or ``None``.

    Every save to a remote tier goes through a pool slot first, so a pool that holds fewer chunks than
    one engine step computes (``step_tokens``) publishes only what fits.
    """
    backend = config.backend
    if not backend.REMOTE:
        return None
    have = pool_slots(config, engine, engine.tp_size)
    need = -(-step_tokens // config.chunk_tokens)
    if have == 0 or have >= need:  # no pool: the remote tier moves every chunk itself
        return None
    enough = need * engine.tp_size * _group_slots_bytes(config, engine)
    return (
        f"kvcore: {host_field(config)}={backend.host_bytes} stages {have} chunk(s) per rank, but "
        f"one step can save {need} ({step_tokens} tokens): saves beyond what fits are neither kept nor "
        f"published to the {backend.KIND} tier; set it to at least {enough} bytes"
    )


def host_field(config: KVCoreConfig) -> str:
    """The key that sizes the host pool, as the config spells it: ``backend.<its HOST_FIELD>``, or the
    first tier's size in a stack of tiers."""
    if isinstance(config.backend, TierStack):
        return config.backend.host_field
    return f"backend.{config.backend.HOST_FIELD}"
