"""Identifier types shared by the core, the ports and the backends.

They are ``NewType``s over ``str``/``int`` rather than classes: they sit on the hot path (dict keys, list
indices) where a wrapper object per value would cost an allocation each.
"""

from __future__ import annotations

from typing import NewType

__all__ = ["ChunkKey", "JobId", "LookupId", "RequestId"]

ChunkKey = NewType("ChunkKey", str)
"""Namespace digest + shard + chunk hash, rendered as text (see ``kvcore.keying.keys``)."""

JobId = NewType("JobId", int)
"""An asynchronous unit of work handed to a backend: submit -> id, poll -> result."""

LookupId = NewType("LookupId", int)
"""A submitted existence check on a remote index."""

RequestId = NewType("RequestId", str)
"""The engine's request id; for managed tiers it names the session."""
