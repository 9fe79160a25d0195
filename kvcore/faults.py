"""``FaultHooks``: where a backend lets a test (or instrumentation) slow down or fail its work on purpose.

A backend that offers them takes ``faults=`` at construction (default ``None``: no hooks, no cost) and
calls them on the thread that does the work, just before the work touches the tier, so that an injected
failure leaves exactly the state a real one would. Subclass ``FaultHooks`` and override the points you
need; the others do nothing. ``kvcore.testing.faults.InjectedFaults`` implements them for the
conformance suite (``fail_next``, ``stall``).

Who calls what: ``before_transfer`` the CPU block mover (per job, on its worker thread) and the Mooncake
store (per batch, on its job thread); ``before_lookup`` the Mooncake index (per lookup, on its thread).
"""

from __future__ import annotations

from kvcore.ports import Direction

__all__ = ["FaultHooks", "leading_failures"]


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

    def before_lookup(self, keys: int) -> None:
        """Before a lookup of ``keys`` keys asks the tier; raising ``BackendError`` fails the lookup."""


def leading_failures(faults: FaultHooks | None, direction: Direction, items: int) -> int:
    """``faults.before_transfer``, within ``[0, items]`` (0 without hooks)."""
    if faults is None:
        return 0
    return min(max(faults.before_transfer(direction, items), 0), items)
