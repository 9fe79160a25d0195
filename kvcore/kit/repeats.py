"""``RepeatedWarnings``: a warning that keeps recurring (a tier that is down, a disk that is full) is
logged the first time and then at most once per interval, with how often it recurred meanwhile — not
once per op, chunk or item, which would bury everything else in the log."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["RepeatedWarnings"]


class RepeatedWarnings:
    """Warnings to ``logger``, each distinct text at most once per ``interval`` seconds (the first time at
    once, later ones with the count of those held back). Thread-safe. At most ``_MAX_TEXTS`` texts are
    remembered: a flood of distinct texts is not throttled, but never grows without bound."""

    _MAX_TEXTS = 256

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self._log = logger
        self._interval = interval
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # text -> (last logged, recurrences since)

    def warn(self, text: str) -> None:
        """Log ``text`` (prefixed ``kvcore: ``) unless it was logged less than ``interval`` seconds ago."""
        now = time.monotonic()
        with self._lock:
            logged, since = self._seen.get(text, (-self._interval, 0))
            if now - logged < self._interval:
                self._seen[text] = (logged, since + 1)
                return
            if len(self._seen) >= self._MAX_TEXTS:
                self._seen.clear()
            self._seen[text] = (now, 0)
        self._log.warning("kvcore: %s%s", text, f" (and {since} more times since)" if since else "")
