"""vLLM builds one connector object per process and role: this is the check that a hook reached the half
of the connector that lives in its process."""

from __future__ import annotations

from typing import TypeVar

from kvcore.errors import InvalidSpecError

__all__ = ["require_side"]

Side = TypeVar("Side")


def require_side(side: Side | None, role: str) -> Side:
    """The connector's ``role`` half (``"scheduler"`` or ``"worker"``); a hook of the half that this
    process does not run is a usage error, never a silent no-op."""
    if side is None:
        other = "worker" if role == "scheduler" else "scheduler"
        raise InvalidSpecError(f"{role}-side hook called on a {other}-side connector")
    return side
