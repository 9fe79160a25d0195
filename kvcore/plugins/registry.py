"""Finds the backends and engine memories that installed distributions register (``kvcore.plugins``).

Each entry-point group is read once per process, on first use. An entry whose object cannot be loaded or
does not fit its protocol (a backend whose ``kind`` or config ``KIND`` is not its entry's name) is left
out with a logged warning, and named in the error of a config that asks for it: one broken plugin never
stops the others. ``register_backend`` and ``register_engine_memory`` add one without a distribution (an
engine that embeds its own backend, a test).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Generic, TypeVar

from kvcore.errors import ConfigError, UsageError
from kvcore.kit.settings import did_you_mean
from kvcore.plugins import Backend, EngineChecks, EngineMemory

__all__ = [
    "BACKENDS_GROUP",
    "ENGINE_CHECKS_GROUP",
    "ENGINE_MEMORY_GROUP",
    "backend",
    "backends",
    "engine_checks",
    "engine_memory",
    "expected_kinds",
    "register_backend",
    "register_engine_memory",
    "unregister_backend",
]

BACKENDS_GROUP = "kvcore.backends"
ENGINE_MEMORY_GROUP = "kvcore.engine_memory"
ENGINE_CHECKS_GROUP = "kvcore.engine_checks"

log = logging.getLogger(__name__)

_Plugin = TypeVar("_Plugin", Backend, EngineMemory, EngineChecks)


class _Group(Generic[_Plugin]):
    """One entry-point group: its plugins by name, and why the broken ones were left out."""

    def __init__(self, group: str, check: Callable[[str, object], _Plugin]) -> None:
        self._group = group
        self._check: Callable[[str, object], _Plugin] = check
        self._lock = threading.Lock()
        self._plugins: dict[str, _Plugin] | None = None
        self.broken: dict[str, str] = {}

    def plugins(self) -> Mapping[str, _Plugin]:
        with self._lock:
            if self._plugins is None:
                self._plugins = dict(self._load())
            return dict(self._plugins)

    def _load(self) -> Iterator[tuple[str, _Plugin]]:
        for entry in entry_points(group=self._group):
            try:
                yield entry.name, self._check(entry.name, entry.load())
            except Exception as exc:  # a broken plugin is reported, never fatal to the others
                self.broken[entry.name] = f"{entry.value}: {type(exc).__name__}: {exc}"
                log.warning("kvcore: %s plugin %r is left out (%s)", self._group, entry.name, exc)

    def add(self, name: str, plugin: object) -> None:
        checked = self._check(name, plugin)
        plugins = self.plugins()
        with self._lock:
            assert self._plugins is not None
            if name in plugins and plugins[name] is not checked:
                raise UsageError(f"{self._group}: {name!r} is registered already, by {plugins[name]!r}")
            self._plugins[name] = checked
            self.broken.pop(name, None)

    def remove(self, name: str) -> None:
        self.plugins()
        with self._lock:
            assert self._plugins is not None
            self._plugins.pop(name, None)


def _checked_backend(name: str, plugin: object) -> Backend:
    if not isinstance(plugin, Backend):
        raise UsageError(f"backend {name!r}: {plugin!r} has not the attributes of kvcore.plugins.Backend")
    if plugin.kind != name or getattr(plugin.config_class, "KIND", None) != name:
        raise UsageError(
            f"backend {name!r}: its kind is {plugin.kind!r} and its config class's KIND "
            f"{getattr(plugin.config_class, 'KIND', None)!r}; both must be the entry point's name"
        )
    return plugin


def _checked_memory(name: str, plugin: object) -> EngineMemory:
    if not isinstance(plugin, EngineMemory) or plugin.name != name:
        raise UsageError(f"engine memory {name!r}: {plugin!r} is not a kvcore.plugins.EngineMemory named so")
    return plugin


def _checked_checks(name: str, plugin: object) -> EngineChecks:
    if not isinstance(plugin, EngineChecks) or plugin.name != name:
        raise UsageError(f"engine checks {name!r}: {plugin!r} is not a kvcore.plugins.EngineChecks named so")
    return plugin


_BACKENDS = _Group[Backend](BACKENDS_GROUP, _checked_backend)
_MEMORIES = _Group[EngineMemory](ENGINE_MEMORY_GROUP, _checked_memory)
_CHECKS = _Group[EngineChecks](ENGINE_CHECKS_GROUP, _checked_checks)


def engine_checks() -> Mapping[str, EngineChecks]:
    """Every engine adapter's pre-flight, by engine name."""
    return _CHECKS.plugins()


def backends() -> Mapping[str, Backend]:
    """Every backend that can be used, by kind."""
    return _BACKENDS.plugins()


def backend(kind: object) -> Backend:
    """The backend of ``kind``. Raises ``ConfigError`` naming ``backend.kind`` and listing the installed
    kinds (and the broken ones, with why) for any other value."""
    found = backends()
    if isinstance(kind, str) and kind in found:
        return found[kind]
    raise ConfigError("backend.kind", kind, expected_kinds(kind))


def expected_kinds(given: object = None) -> str:
    """What ``backend.kind`` may be: the installed kinds (the one closest to ``given``, a typo of it), and
    the broken ones with why they are not."""
    found = backends()
    kinds = f"one of {', '.join(map(repr, sorted(found)))}" if found else "an installed backend (none is)"
    kinds += did_you_mean(given, found)
    if _BACKENDS.broken:
        kinds += "; left out as broken: " + "; ".join(
            f"{name!r} ({why})" for name, why in _BACKENDS.broken.items()
        )
    return kinds


def register_backend(plugin: Backend) -> None:
    """Make ``plugin`` selectable by its ``kind`` in this process. Raises ``UsageError`` for an object that
    is not a ``Backend`` or a kind another backend holds."""
    _BACKENDS.add(getattr(plugin, "kind", repr(plugin)), plugin)


def unregister_backend(kind: str) -> None:
    """Forget the backend of ``kind`` in this process (one that ``register_backend`` added, or an
    installed one); unknown kinds are ignored."""
    _BACKENDS.remove(kind)


def engine_memory(tensors: Sequence[object]) -> EngineMemory:
    """The engine memory that accepts ``tensors``. Raises ``UsageError`` when none does (the tensor
    library's plugin is not installed: ``kvcore[cpu]`` brings torch's)."""
    memories = _MEMORIES.plugins()
    for memory in memories.values():
        if memory.accepts(tensors):
            return memory
    kinds = type(tensors[0]).__name__ if tensors else "no tensors"
    raise UsageError(
        f"tensors: no installed engine memory accepts {kinds} "
        f"(installed: {sorted(memories) or 'none'}; broken: {_MEMORIES.broken or 'none'})"
    )


def register_engine_memory(plugin: EngineMemory) -> None:
    """Make ``plugin`` hold engine KV in this process (see ``register_backend``)."""
    _MEMORIES.add(getattr(plugin, "name", repr(plugin)), plugin)
