"""One composition for every engine: a config, an engine spec and each rank's KV tensors in, the
scheduler side and the rank workers out, whatever the backend.

The backend comes from the registry by ``config.backend.kind`` (``kvcore.plugins.registry``), the engine memory
by the tensors' library. A stack of tiers (``kvcore.config.tiers``) opens each remote tier's backend with its
own settings, and cascades them (``kvcore.scheduling.cascade_index``, ``kvcore.execution.cascade_remote``) when there are several or one is written back.
vLLM's connector, the CLI's demo and any other engine build kvcore through these two calls
(docs/engine-api.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs

from kvcore.checks import is_int_in
from kvcore.config.model import KVCoreConfig
from kvcore.config.tiers import TierStack
from kvcore.errors import ConfigError
from kvcore.execution.cascade_remote import CascadeRemote
from kvcore.execution.worker import BlockWorker
from kvcore.kit.closing import close_quietly
from kvcore.kit.faults import FaultHooks
from kvcore.model.engine import EngineSpec
from kvcore.plugins import Backend
from kvcore.plugins.registry import backend, engine_memory
from kvcore.plugins.sizing import pool_slots
from kvcore.ports import ChunkIndex, RankMemory, RemoteTier
from kvcore.scheduling.cascade_index import cascade_index
from kvcore.scheduling.scheduler import CacheScheduler

__all__ = ["open_scheduler", "open_worker"]

Opened = TypeVar("Opened", ChunkIndex, RemoteTier)


def open_scheduler(
    config: KVCoreConfig, engine: EngineSpec, *, hash_identity: str | None = None
) -> CacheScheduler:
    """The scheduler side for ``engine``: the index of its host slots (``pool_slots`` per rank) and of the
    backend's tier beyond them. ``hash_identity`` names the engine's own block hashing when lookups pass
    its block hashes (see ``CacheScheduler``). Raises ``ConfigError`` as ``pool_slots`` does, and for a
    backend that is not installed; the backend's index is then closed again."""
    slots = pool_slots(config, engine, engine.tp_size)
    index = _cascade_index(config, engine)
    try:
        return CacheScheduler(
            config, engine, slots, world_size=engine.tp_size, hash_identity=hash_identity, remote=index
        )
    except BaseException:
        close_quietly(index)
        raise


def open_worker(
    config: KVCoreConfig,
    engine: EngineSpec,
    tensors: Sequence[object],
    *,
    rank: int = 0,
    faults: FaultHooks | None = None,
) -> BlockWorker:
    """Rank ``rank``'s worker over its KV ``tensors`` (one per layer, the engine's layout): its host
    slots, its mover and the backend's remote tier over them. The rank's movers call ``faults``
    (``kvcore.kit.faults``: tests, instrumentation) before each copy. Raises ``ConfigError`` for a rank
    outside the engine's ``tp_size`` or a backend that is not installed, ``UsageError`` for tensors no
    installed engine memory accepts or that do not match the engine, or ``faults`` its movers cannot
    call; nothing then stays open."""
    if not is_int_in(rank, 0, engine.tp_size - 1):
        raise ConfigError("rank", rank, f"an int in [0, {engine.tp_size}) (the engine's tp_size)")

    def remote(memory: RankMemory) -> RemoteTier | None:
        opened = _open_each(config, lambda tier, plugin: plugin.open_remote(tier, engine, memory))
        stack = config.backend
        if not isinstance(stack, TierStack) or (len(opened) < 2 and not stack.writes_back):
            return opened[0] if opened else None
        return CascadeRemote(
            opened, [t.admit_after for t in stack.remote], [t.writes_back for t in stack.remote]
        )

    memory = engine_memory(tensors)
    if faults is None:  # an engine memory written before ``faults`` existed still opens workers
        return memory.open_worker(config, engine, tensors, rank=rank, remote=remote)
    return memory.open_worker(config, engine, tensors, rank=rank, remote=remote, faults=faults)


def _tiers(config: KVCoreConfig) -> tuple[KVCoreConfig, ...]:
    """A config per remote tier behind the pool, whose ``backend`` is that tier's settings (what its
    backend opens from); the config itself when it names one backend."""
    if isinstance(config.backend, TierStack):
        return tuple(attrs.evolve(config, backend=tier.settings) for tier in config.backend.remote)
    return (config,)


def _open_each(
    config: KVCoreConfig, open_one: Callable[[KVCoreConfig, Backend], Opened | None]
) -> list[Opened]:
    """``open_one`` for every remote tier, in order (those that open nothing left out). If one fails,
    the ones opened are closed again; in a stack, a ``ConfigError`` a backend raised about its own
    fields (``backend.<field>``) names them as the stack does (``tiers[<n>].<field>``)."""
    opened: list[Opened] = []
    stacked = isinstance(config.backend, TierStack)
    try:
        for n, tier in enumerate(_tiers(config), start=1):
            try:
                one = open_one(tier, backend(tier.backend.KIND))
            except ConfigError as exc:
                if not stacked or not exc.field.startswith("backend."):
                    raise
                raise ConfigError(
                    exc.field.replace("backend.", f"tiers[{n}].", 1), exc.value, exc.expected
                ) from exc
            if one is not None:
                opened.append(one)
    except BaseException:
        for one in opened:
            close_quietly(one)
        raise
    return opened


def _cascade_index(config: KVCoreConfig, engine: EngineSpec) -> ChunkIndex | None:
    """The index of every remote tier, cascading when there are several (``kvcore.scheduling.cascade_index``, ``kvcore.execution.cascade_remote``); a lookup
    of the cascade answers within three quarters of ``lookup_timeout_s``, what it found so far."""
    opened = _open_each(config, lambda tier, plugin: plugin.open_index(tier, engine))
    if len(opened) < 2:
        return opened[0] if opened else None
    return cascade_index(opened, 0.75 * config.lookup_timeout_s)
