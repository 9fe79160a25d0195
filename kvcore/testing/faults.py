"""Fault hooks for tests (``kvcore.kit.faults``): the conformance suite's failures and stalls, and a gate.

``InjectedFaults`` is the one implementation of ``SupportsFailureInjection`` and ``SupportsStall``
(``kvcore.testing.capabilities``) for every backend: the in-memory references consult it directly, and a
real backend is built with it as its ``faults`` (the CPU block mover, the Mooncake store and index), so
that its harness just forwards ``fail_next`` and ``stall``. ``TransferGate`` holds transfers until a
test lets them go, to act while a copy is in progress; ``TransferDelays`` makes every transfer of a
direction take longer (a slow tier), e.g. in a served engine's workers, named by import path there.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from kvcore.errors import BackendError, TransferTimeout, UsageError
from kvcore.kit.faults import FaultHooks
from kvcore.ports import Direction

__all__ = ["InjectedFaults", "TransferDelays", "TransferGate"]


class InjectedFaults(FaultHooks):
    """Counts the items still to fail and the stalls entered; thread-safe.

    A stalled hook waits until the stall is left, or at most ``stall_limit_s``: a backend that calls its
    hooks under a lock which a call of the test needs while it stalls (a store's ``clear`` waits for the
    batch in progress) goes on after that bound instead of deadlocking the test.
    """

    def __init__(self, *, stall_limit_s: float | None = None) -> None:
        self._cond = threading.Condition()
        self._failures = 0
        self._stalls = 0
        self._limit = stall_limit_s

    def fail_next(self, count: int) -> None:
        """The next ``count`` items processed fail (see ``SupportsFailureInjection``)."""
        if count < 0:
            raise UsageError(f"fail_next: count: got {count}, expected a count >= 0")
        with self._cond:
            self._failures += count

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        """While inside, work that reaches a hook (or ``wait_released``) waits."""
        with self._cond:
            self._stalls += 1
        try:
            yield
        finally:
            with self._cond:
                self._stalls -= 1
                self._cond.notify_all()

    @property
    def stalled(self) -> bool:
        with self._cond:
            return self._stalls > 0

    def wait_released(self) -> None:
        """Block while a stall is entered (at most ``stall_limit_s``)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._stalls, self._limit)

    def take(self, count: int) -> int:
        """How many of the next ``count`` items fail (leading ones), counted off ``fail_next``."""
        with self._cond:
            failed = min(self._failures, count)
            self._failures -= failed
            return failed

    def before_transfer(self, direction: Direction, items: int) -> int:
        self.wait_released()
        return self.take(items)

    def before_lookup(self, keys: int) -> None:
        self.wait_released()
        if self.take(1):
            raise BackendError("lookup failed (injected)")


class TransferGate(FaultHooks):
    """Holds every transfer until ``opened`` is set; one still held after ``limit_s`` fails (raises
    ``TransferTimeout``), so that a test that never opens the gate fails instead of hanging a worker.

    ``entered`` is set once a transfer reached the gate; ``order`` lists the directions of the transfers
    in the order they reached it.
    """

    def __init__(self, limit_s: float) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.order: list[Direction] = []
        self._limit = limit_s

    def before_transfer(self, direction: Direction, items: int) -> int:
        self.order.append(direction)
        self.entered.set()
        if not self.opened.wait(self._limit):
            raise TransferTimeout(f"the test kept the gate closed for {self._limit:.1f}s")
        return 0


class TransferDelays(FaultHooks):
    """Every transfer of a direction first sleeps that direction's delay (none until ``slow`` sets one);
    thread-safe, so that a test can slow a live engine's tier and restore it while copies run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delays: dict[Direction, float] = {}

    def slow(self, direction: Direction, delay_s: float) -> None:
        """From now on, each transfer ``direction`` sleeps ``delay_s`` seconds first (0: not at all)."""
        if not isinstance(direction, Direction):
            raise UsageError(f"direction: got {direction!r}, expected a Direction")
        if not 0 <= delay_s <= 600:
            raise UsageError(f"delay_s: got {delay_s!r}, expected seconds in [0, 600]")
        with self._lock:
            self._delays[direction] = delay_s

    def clear(self) -> None:
        """No delay in either direction (transfers already sleeping finish their sleep)."""
        with self._lock:
            self._delays.clear()

    def before_transfer(self, direction: Direction, items: int) -> int:
        with self._lock:
            delay = self._delays.get(direction, 0.0)
        if delay:
            time.sleep(delay)
        return 0
