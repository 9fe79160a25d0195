"""``FaultHooks``: where a backend lets a test (or instrumentation) slow down or fail its work on purpose.

A backend that offers them takes ``faults=`` at construction (default ``None``: no hooks, no cost) and
calls them on the thread that does the work, just before the work touches the tier, so that an injected
failure leaves exactly the state a real one would. Subclass ``FaultHooks`` and override the points you
need; the others do nothing. ``kvcore.testing.faults.InjectedFaults`` implements them for the
conformance suite (``fail_next``, ``stall``).

Who calls what: ``before_transfer`` the CPU block mover (per job, on its worker thread) and the Mooncake
store (per batch, on its job thread); ``before_queue`` the CPU block mover (per job, on the submitting
thread); ``before_lookup`` the Mooncake index (per lookup, on its thread).

An engine hands a rank's hooks to ``kvcore.plugins.compose.open_worker(..., faults=)``, which gives them to
the rank's block mover. An engine that builds its workers itself, from a text config (vLLM), names them by
import path instead: ``load_hooks("package.module:NAME")``.
"""

from __future__ import annotations

import importlib

from kvcore.errors import ConfigError
from kvcore.ports import Direction

__all__ = ["FaultHooks", "leading_failures", "load_hooks"]


class FaultHooks:
    """Hook points, each a no-op here. They may block (a stall: the work waits, its job stays in flight)
    or raise (the whole job or lookup fails with the exception's text)."""

    def before_transfer(self, direction: Direction, items: int) -> int:
        """Before ``items`` items (block pairs, store items) move ``direction`` (``LOAD``: toward the engine,
        a load or a get; ``SAVE``: away from it, a save or a put).

        Returns how many leading items fail as the tier failing them would (their destination bytes are
        undefined) instead of moving: 0 moves them all.
        """
        return 0

    def before_queue(self, direction: Direction, items: int) -> None:
        """On the submitting thread, before a copy of ``items`` block pairs is queued. Raising stands for
        a queue that cannot take it: a ``UsageError`` refuses the submit with no job left (a closed
        queue), another ``Exception`` fails the whole job (a device that cannot launch the copy), and
        anything else (an interrupt) propagates with no job left."""

    def before_lookup(self, keys: int) -> None:
        """Before a lookup of ``keys`` keys asks the tier; raising ``BackendError`` fails the lookup."""


def leading_failures(faults: FaultHooks | None, direction: Direction, items: int) -> int:
    """``faults.before_transfer``, within ``[0, items]`` (0 without hooks)."""
    if faults is None:
        return 0
    return min(max(faults.before_transfer(direction, items), 0), items)


def load_hooks(path: object, *, field: str = "faults") -> FaultHooks:
    """The ``FaultHooks`` that ``path`` (``"package.module:NAME"``) names: ``NAME`` is a ``FaultHooks``
    instance (the same object for every caller in the process, so that whoever imports the module steers
    it), or a subclass, made anew with no arguments for each caller. Raises ``ConfigError`` naming
    ``field`` and ``path`` for a path of another form, a module that does not import, a name that is
    neither, or a subclass that cannot be made so."""
    module_name, colon, name = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not (colon and module_name and name.isidentifier()):
        raise ConfigError(field, path, "an import path 'package.module:NAME'")
    try:
        found: object = getattr(importlib.import_module(module_name), name)
    except Exception as exc:  # a module that fails as it is imported names no hooks either
        raise ConfigError(field, path, f"an importable name ({type(exc).__name__}: {exc})") from None
    if isinstance(found, FaultHooks):
        return found
    if not (isinstance(found, type) and issubclass(found, FaultHooks)):
        raise ConfigError(field, path, f"a kvcore.kit.faults.FaultHooks or a subclass, not {found!r}")
    try:
        return found()
    except Exception as exc:
        made = f"hooks made with no arguments ({type(exc).__name__}: {exc})"
        raise ConfigError(field, path, made) from None
