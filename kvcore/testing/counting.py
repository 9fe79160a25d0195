"""``CallCounter``: a proxy that counts the calls made through it, by method name (how many requests a
client sends, in a test or a benchmark)."""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["CallCounter"]


class CallCounter:
    """Forwards every attribute to ``target``, counting the calls of its methods in ``calls``."""

    def __init__(self, target: object) -> None:
        self._target = target
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return call
