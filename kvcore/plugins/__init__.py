"""What a distribution registers to plug into kvcore: a backend per ``kind``, and the engine memory of a
tensor library; and the only place that puts them together for an engine (``compose``).

A **backend** (entry-point group ``kvcore.backends``, one entry per ``kind``) owns its config class and
opens the two halves of its tier for an engine: the scheduler side's index of the chunks the tier holds
beyond the local pool, and each rank's remote tier over that rank's memory, as the port it implements
(a ``ChunkStore`` or a ``ManagedTier``; ``compose`` makes it the worker's ``RemoteTier``). A backend that
keeps chunks in the local pool only (the ``cpu`` kind) opens neither.

An **engine memory** (entry-point group ``kvcore.engine_memory``, one entry per tensor library) holds a
rank's engine KV tensors and its host pool and runs the block mover between them; it opens a rank's
``BlockWorker`` and hands the remote tier's opener that rank's memory (``kvcore.ports.RankMemory``). So a
backend never depends on a tensor library, and a tensor library on no backend.

An **engine's checks** (entry-point group ``kvcore.engine_checks``, one entry per engine adapter) read
what a person gives that engine (vLLM's ``--kv-transfer-config``) as the engine will, for ``kvcore
doctor`` (``kvcore.plugins.preflight``): the same checks the adapter runs before its engine starts.

``kvcore.plugins.registry`` finds all three; ``kvcore.plugins.compose`` puts the first two together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar, runtime_checkable

from kvcore.errors import UsageError

if TYPE_CHECKING:  # the config reads backends through the registry, which checks them against these
    from kvcore.config.model import KVCoreConfig
    from kvcore.execution.worker import BlockWorker
    from kvcore.kit.faults import FaultHooks
    from kvcore.kit.settings import BackendSettings
    from kvcore.model.engine import EngineSpec
    from kvcore.plugins.preflight import EngineFlags, Report
    from kvcore.ports import BlockMover, ChunkIndex, ChunkStore, ManagedTier, RankMemory, RemoteTier

__all__ = [
    "Backend",
    "EngineChecks",
    "EngineMemory",
    "MoverWrap",
    "RemoteOpener",
    "RemotePort",
    "settings_of",
]

RemotePort: TypeAlias = "ChunkStore | ManagedTier | RemoteTier"
"""What a backend's ``open_remote`` returns: the port it implements (a ``RemoteTier`` it made itself is
taken as it is)."""


@runtime_checkable
class Backend(Protocol):
    """One backend kind: ``{"backend": {"kind": kind, ...}}`` selects it.

    ``config_class`` structures the rest of the ``backend`` section (its ``KIND`` is ``kind``; read it
    back from a config with ``settings_of``). Both ``open_*`` methods may import what the backend needs
    (a native client, a socket library) on first use: loading the object from its entry point must stay
    cheap, since every installed backend is loaded to read any config. What either returns is closed by
    kvcore (``close`` where it has one).

    In vLLM, ``open_index`` runs in the engine-core process and ``open_remote`` in each worker process:
    the two halves meet only in the tier itself (a server, a folder), never in a process's memory.
    """

    @property
    def kind(self) -> str: ...

    @property
    def config_class(self) -> type[BackendSettings]: ...

    def open_index(self, config: KVCoreConfig, engine: EngineSpec) -> ChunkIndex | None:
        """The scheduler side's index of the tier beyond the local pool, or ``None`` (no such tier)."""
        ...

    def open_remote(self, config: KVCoreConfig, engine: EngineSpec, memory: RankMemory) -> RemotePort | None:
        """One rank's remote tier over its memory, as the port the backend implements, or ``None`` (no
        such tier). Raises ``ConfigError`` for memory the tier cannot work with (no host pool where it
        needs one)."""
        ...


RemoteOpener: TypeAlias = "Callable[[RankMemory], RemoteTier | None]"
"""Opens a rank's remote tier over its memory: the backends' ``open_remote`` with the config bound, made
``RemoteTier``s (``kvcore.plugins.compose``)."""

MoverWrap: TypeAlias = "Callable[[BlockMover], BlockMover]"
"""Wraps the block mover an engine memory made for a rank: the worker drives what it returns (a test's
faulty mover, an instrumented one)."""


@runtime_checkable
class EngineMemory(Protocol):
    """How one tensor library holds a rank's engine KV and host pool."""

    @property
    def name(self) -> str: ...

    def accepts(self, tensors: Sequence[object]) -> bool:
        """Whether ``tensors`` (one KV tensor per layer) are this library's."""
        ...

    def open_rank(
        self,
        config: KVCoreConfig,
        engine: EngineSpec,
        tensors: Sequence[object],
        *,
        rank: int,
        remote: RemoteOpener,
        faults: FaultHooks | None = None,
        mover: MoverWrap | None = None,
    ) -> BlockWorker:
        """Register the rank's tensors, allocate its host pool (``kvcore.plugins.sizing.pool_slots``),
        start its mover (driven through ``mover`` when given) and open its remote tier through ``remote``;
        every mover of the rank calls ``faults`` (``kvcore.kit.faults``) before each copy. Raises
        ``UsageError`` for tensors, a rank, a config or ``faults`` that do not fit the engine; nothing then
        stays allocated."""
        ...


@runtime_checkable
class EngineChecks(Protocol):
    """An engine adapter's pre-flight of the config its engine is given, in that engine's form."""

    @property
    def name(self) -> str: ...

    def accepts(self, data: Mapping[str, object]) -> bool:
        """Whether ``data`` is this engine's form of a config (vLLM: a ``--kv-transfer-config``)."""
        ...

    def check(self, data: Mapping[str, object], flags: EngineFlags) -> Sequence[tuple[str, Report]]:
        """The pre-flight of each kvcore config in ``data`` (``data`` may also be kvcore's config alone),
        named (vLLM: by connector), as the engine runs it with what ``flags`` say of the engine. Raises
        ``ConfigError`` for what the adapter refuses before any tier is checked."""
        ...


Settings = TypeVar("Settings")


def settings_of(config: KVCoreConfig, cls: type[Settings]) -> Settings:
    """``config.backend`` as the backend's own settings class ``cls``: what a backend's ``open_*`` read
    their fields from. Raises ``UsageError`` when it is another's (a backend opened with another kind's
    config)."""
    if not isinstance(config.backend, cls):
        raise UsageError(f"config.backend: got {config.backend!r}, expected a {cls.__name__}")
    return config.backend
