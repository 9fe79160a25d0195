"""One composition for every engine: a config, an engine spec and each rank's KV tensors in, the scheduler
side and the rank workers out, whatever the backend. The only place that assembles either side.

The backend comes from the registry by ``config.backend.kind`` (``kvcore.plugins.registry``), the engine
memory by the tensors' library. A stack of tiers (``kvcore.config.tiers``) opens each remote tier's
backend with its own settings, and cascades them when there are several or one is written back
(``kvcore.scheduling.cascade_index`` on the scheduler side, ``kvcore.execution.cascade_remote`` on each
rank). A backend's remote tier is the port it implements; it becomes the rank's ``RemoteTier`` here
(``kvcore.execution.remote``). vLLM's connector, the CLI's demo, the lifecycle fuzzer and any other engine
build kvcore through these two calls (docs/engine-api.md); a test or a fuzzer may give the index, the
remote tiers or a wrapper of the mover instead of what the config names.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import attrs

from kvcore.checks import is_int_in
from kvcore.config.model import KVCoreConfig
from kvcore.config.tiers import TierStack
from kvcore.errors import ConfigError, UsageError
from kvcore.execution.cascade_remote import CascadeRemote
from kvcore.execution.remote import ManagedRemote, StoreRemote
from kvcore.execution.worker import BlockWorker
from kvcore.kit.closing import close_quietly
from kvcore.kit.faults import FaultHooks
from kvcore.model.engine import EngineSpec
from kvcore.model.head_runs import HeadRuns
from kvcore.plugins import Backend, MoverWrap, RemoteOpener, RemotePort
from kvcore.plugins.registry import backend, engine_memory
from kvcore.plugins.sizing import keeps_head_values, pool_slots
from kvcore.ports import ChunkIndex, ChunkStore, ManagedTier, RankMemory, RemoteTier
from kvcore.scheduling.cascade_index import cascade_index
from kvcore.scheduling.scheduler import CacheScheduler

__all__ = ["FROM_CONFIG", "FromConfig", "open_scheduler", "open_worker"]


class FromConfig(enum.Enum):
    """The default of an override: what the config names."""

    FROM_CONFIG = "from the config"


FROM_CONFIG = FromConfig.FROM_CONFIG

Opened = TypeVar("Opened", ChunkIndex, RemoteTier)


def open_scheduler(
    config: KVCoreConfig,
    engine: EngineSpec,
    *,
    hash_identity: str | None = None,
    index: ChunkIndex | Literal[FromConfig.FROM_CONFIG] | None = FROM_CONFIG,
    write_back: bool | Literal[FromConfig.FROM_CONFIG] = FROM_CONFIG,
    per_head: Sequence[bool] | Literal[FromConfig.FROM_CONFIG] = FROM_CONFIG,
    threaded_lookups: bool = True,
) -> CacheScheduler:
    """The scheduler side for ``engine``: the index of its host slots (``pool_slots`` per rank) and of the
    tiers beyond them. ``hash_identity`` names the engine's own block hashing when lookups pass its block
    hashes (see ``CacheScheduler``). ``index`` replaces the index of the tiers the config names (``None``:
    no tier beyond the pool), ``write_back`` whether one of them is written back (by default, whether one
    of the config's is), ``per_head`` which of them keep a value per KV head (by default, those of the
    config that do: the keys the workers write under follow the config, so an index given in its place
    must answer for them), ``threaded_lookups`` as ``CacheScheduler`` takes it. Raises ``ConfigError``
    as ``pool_slots`` does, and for a backend that is not installed; an index opened here is then closed
    again."""
    slots = pool_slots(config, engine, engine.tp_size)
    opened, flags = (
        _cascade_index(config, engine) if index is FROM_CONFIG else (index, _flags(config, engine))
    )
    stack = config.backend
    try:
        return CacheScheduler(
            config,
            engine,
            slots,
            world_size=engine.tp_size,
            hash_identity=hash_identity,
            remote=opened,
            per_head=flags if per_head is FROM_CONFIG else tuple(per_head),
            threaded_lookups=threaded_lookups,
            write_back=(isinstance(stack, TierStack) and stack.writes_back)
            if write_back is FROM_CONFIG
            else write_back,
        )
    except BaseException:
        if index is FROM_CONFIG:
            close_quietly(opened)
        raise


def open_worker(
    config: KVCoreConfig,
    engine: EngineSpec,
    tensors: Sequence[object],
    *,
    rank: int = 0,
    faults: FaultHooks | None = None,
    remote: RemoteOpener | Literal[FromConfig.FROM_CONFIG] = FROM_CONFIG,
    mover: MoverWrap | None = None,
) -> BlockWorker:
    """Rank ``rank``'s worker over its KV ``tensors`` (one per layer, the engine's layout): its host
    slots, its mover and the remote tiers over them. The rank's movers call ``faults``
    (``kvcore.kit.faults``: tests, instrumentation) before each copy. ``remote`` opens the rank's remote
    tier instead of the config's backends (over the same ``RankMemory``); ``mover`` wraps the mover the
    worker drives. Raises ``ConfigError`` for a rank outside the engine's ``tp_size`` or a backend that is
    not installed, ``UsageError`` for tensors no installed engine memory accepts or that do not match the
    engine, or ``faults`` its movers cannot call; nothing then stays open."""
    if not is_int_in(rank, 0, engine.tp_size - 1):
        raise ConfigError("rank", rank, f"an int in [0, {engine.tp_size}) (the engine's tp_size)")
    opener = _remote_tiers(config, engine) if remote is FROM_CONFIG else remote
    memory = engine_memory(tensors)
    return memory.open_rank(config, engine, tensors, rank=rank, remote=opener, faults=faults, mover=mover)


def as_remote_tier(port: RemotePort, heads: HeadRuns | None = None) -> RemoteTier:
    """The worker's ``RemoteTier`` over a backend's port: a ``ChunkStore`` (``StoreRemote``; ``heads``:
    one value per KV head, the rank's runs), a ``ManagedTier`` (``ManagedRemote``) or a ``RemoteTier`` as
    it is. (A managed or remote tier of a backend that keeps values per KV head splits them itself: its
    calls name chains, which only it can split.) Raises ``UsageError`` for anything else."""
    if isinstance(port, RemoteTier):
        return port
    if isinstance(port, ChunkStore):
        return StoreRemote(port, heads)
    if isinstance(port, ManagedTier):
        return ManagedRemote(port)
    raise UsageError(
        f"a backend's open_remote returned {type(port).__name__}: expected a ChunkStore or a ManagedTier"
    )


def _remote_tiers(config: KVCoreConfig, engine: EngineSpec) -> RemoteOpener:
    """Opens a rank's remote tiers from the config: each backend's port as a ``RemoteTier``, several (or
    one written back) as their cascade."""

    heads = HeadRuns.of(engine)

    def remote(memory: RankMemory) -> RemoteTier | None:
        opened = _open_each(
            config,
            lambda tier, plugin: _remote_of(
                plugin.open_remote(tier, engine, memory), heads if keeps_head_values(tier, engine) else None
            ),
        )
        stack = config.backend
        if not isinstance(stack, TierStack) or (len(opened) < 2 and not stack.writes_back):
            return opened[0] if opened else None
        return CascadeRemote(
            opened, [t.admit_after for t in stack.remote], [t.writes_back for t in stack.remote]
        )

    return remote


def _remote_of(port: RemotePort | None, heads: HeadRuns | None) -> RemoteTier | None:
    if port is None:
        return None
    try:
        return as_remote_tier(port, heads)
    except UsageError:
        close_quietly(port)
        raise


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


def _flags(config: KVCoreConfig, engine: EngineSpec) -> tuple[bool, ...]:
    """Whether each remote tier of the config keeps a value per KV head (none without remote tiers)."""
    stack = config.backend
    if isinstance(stack, TierStack) or stack.REMOTE:
        return tuple(keeps_head_values(tier, engine) for tier in _tiers(config))
    return ()


def _cascade_index(config: KVCoreConfig, engine: EngineSpec) -> tuple[ChunkIndex | None, tuple[bool, ...]]:
    """The index of every remote tier, cascading when there are several; a lookup of the cascade
    answers within three quarters of ``lookup_timeout_s``, what it found so far. Each tier is asked for
    keys as it keeps values: by each rank's shard or by each KV head's (the cascade keys each tier);
    beside it, each tier's flag, for the scheduler's keys."""
    flags: list[bool] = []

    def open_index(tier: KVCoreConfig, plugin: Backend) -> ChunkIndex | None:
        index = plugin.open_index(tier, engine)
        if index is not None:
            flags.append(keeps_head_values(tier, engine))
        return index

    opened = _open_each(config, open_index)
    if len(opened) < 2:
        return (opened[0] if opened else None), tuple(flags)
    return cascade_index(opened, 0.75 * config.lookup_timeout_s, flags), tuple(flags)
