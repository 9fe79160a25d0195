"""A circuit breaker: a backend that keeps failing is skipped for a back-off period, then probed again.

While open, lookups answer 0 at once and saves are skipped, so a dead server costs nothing per step; after
the back-off one call is let through (half-open) and its outcome closes or re-opens the breaker. This is
how a restarted server is rejoined without restarting the engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvcore.errors import ConfigError

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """Counts consecutive failures; opens after ``threshold`` of them for ``backoff_s`` seconds."""

    def __init__(
        self, threshold: int = 3, backoff_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if threshold < 1:
            raise ConfigError("threshold", threshold, "an integer >= 1")
        if backoff_s <= 0:
            raise ConfigError("backoff_s", backoff_s, "a number > 0")
        self._threshold = threshold
        self._backoff = backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until = 0.0
        self._probing = False

    def allow(self) -> bool:
        """Whether a call may go to the backend now (one probe at a time once the back-off is over)."""
        with self._lock:
            if self._failures < self._threshold:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._failures >= self._threshold

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._probing = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._probing = False
            if self._failures >= self._threshold:
                self._open_until = self._clock() + self._backoff
