"""The one error hierarchy of kvcore, split by who is at fault.

``UsageError`` and its children mean the caller (or its configuration) asked for something that cannot
be done: fix the call. ``BackendError`` and its children mean a tier, server or device failed: the core
turns them into cache misses and recomputes, never into an engine crash. A miss, or "no room", is a return
value, never an exception.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "ConfigError",
    "IncompatibleLayoutError",
    "InvalidSpecError",
    "KVCoreError",
    "TransferFailed",
    "TransferTimeout",
    "UnsupportedConfiguration",
    "UsageError",
]


class KVCoreError(Exception):
    """Root of every error kvcore raises on purpose."""


class UsageError(KVCoreError, ValueError):
    """The caller asked for something impossible; nothing was changed."""


class ConfigError(UsageError):
    """A configuration value is wrong. The message names the field, the value and what was expected."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"{field}: got {value!r}, expected {expected}")


class UnsupportedConfiguration(UsageError):
    """A valid engine configuration that kvcore does not support yet (refused, never mis-keyed)."""


class InvalidSpecError(UsageError):
    """A request, block list, layout or tensor does not fit what was declared; nothing was copied."""


class IncompatibleLayoutError(InvalidSpecError):
    """Two sides of a transfer cannot exchange KV (TP sizes, heads, dtype, block size or layout)."""


class BackendError(KVCoreError):
    """A tier, server or device failed. Callers degrade: a miss, a recompute, a dropped save."""


class BackendUnavailable(BackendError):
    """The backend cannot be reached or is marked unhealthy; try again after its back-off."""


class TransferFailed(BackendError):
    """A copy or network transfer finished with an error; the destination holds undefined bytes."""


class TransferTimeout(BackendError, TimeoutError):
    """A wait ran out of time; the job may still complete later and is reported by a later poll."""
