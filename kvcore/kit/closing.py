"""Closing what a backend holds (threads, sockets, registered memory) on paths that must go on whatever
one backend does: shutdown, a failed start, a halted worker."""

from __future__ import annotations

import logging
from typing import Protocol

__all__ = ["Closeable", "close_quietly"]

log = logging.getLogger(__name__)


class Closeable(Protocol):
    """A backend object holding threads, sockets or registered memory until closed (every port)."""

    def close(self) -> None: ...


def close_quietly(resource: Closeable | None) -> None:
    """Close ``resource`` unless it is ``None``; a failure is logged, never raised (shutdown paths)."""
    if resource is not None:
        try:
            resource.close()
        except Exception as exc:  # shutdown must go on whatever one backend does
            log.warning("kvcore: closing %s failed: %s", type(resource).__name__, exc)
