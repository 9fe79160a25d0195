"""A dependency-free progress bar on stderr (redrawn in place; silent when disabled)."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self._total = max(total, 1)
        self._enabled = enabled and sys.stderr.isatty()
        self._width = width
        self._last = 0.0

    def update(self, done: int, note: str = "") -> None:
        now = time.monotonic()
        if not self._enabled or (now - self._last < 0.1 and done < self._total):
            return
        self._last = now
        filled = self._width * min(done, self._total) // self._total
        bar = "#" * filled + "." * (self._width - filled)
        sys.stderr.write(f"\r[{bar}] {done}/{self._total} {note}\x1b[K")
        sys.stderr.flush()

    def close(self) -> None:
        if self._enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
