"""What a backend author builds on, beside the ports (``kvcore.ports``): kvcore's own backends are built
from these, and so is the example out-of-tree backend (``docs/examples/dirstore``). A stable surface:
a change to a name here comes with a release in which the old name still works and warns.

- ``lane`` — ``JobLane``: the one job thread a backend runs its work on (reads before writes, a job that
  raises fails alone, ``close`` fails what is queued); ``Priority``, ``LaneClosed``.
- ``lane_store`` — ``LaneStore``: the job half of a ``ChunkStore`` over one host buffer (items checked
  before anything queues, jobs on a lane, ``close``); a subclass runs one ``StoreJob``.
- ``immediate_index`` — ``ImmediateIndex``: the ``ChunkIndex`` port of an index that answers at once; a
  subclass writes ``lookup``.
- ``leading`` — ``leading_chunks``, ``by_chunk``: an index's answer, the leading chunks with every shard.
- ``settings`` — the fields and validators of a backend's config class (``BackendSettings``, ``ByteSize``,
  ``ByteCount``, ``within``, ``seconds``, ...): bad input refused as everywhere else in kvcore;
  ``format_size`` and ``did_you_mean`` for messages.
- ``faults`` — ``FaultHooks``: the documented points where a test fails or stalls a backend's work.
- ``health`` — ``CircuitBreaker``: skip a tier that keeps failing for a back-off, then probe it.
- ``repeats`` — ``RepeatedWarnings``: a warning that recurs, logged once a minute with a count.
- ``closing`` — ``close_quietly``: close on a path that must go on whatever one resource does.
- ``probe`` — ``probe_tcp``: whether a server listens at an address, within a bound (a pre-flight's check).
- ``lazy`` — ``lazy_exports``: a package whose exports import on first use (loading a plugin stays cheap).

The kit imports kvcore's vocabulary and ports only, never the rest of the core.
"""

from __future__ import annotations

from kvcore.kit.closing import Closeable, close_quietly
from kvcore.kit.faults import FaultHooks, leading_failures, load_hooks
from kvcore.kit.health import CircuitBreaker
from kvcore.kit.immediate_index import ImmediateIndex
from kvcore.kit.lane import JobLane, LaneClosed, Priority
from kvcore.kit.lane_store import LaneStore, StoreJob
from kvcore.kit.lazy import lazy_exports
from kvcore.kit.leading import by_chunk, leading_chunks
from kvcore.kit.probe import probe_tcp
from kvcore.kit.repeats import RepeatedWarnings
from kvcore.kit.settings import (
    BackendSettings,
    BadValue,
    ByteCount,
    ByteSize,
    did_you_mean,
    fits_in_memory,
    format_size,
    host_and_port,
    non_empty,
    one_of,
    parse_size,
    seconds,
    within,
    word,
)

__all__ = [
    "BackendSettings",
    "BadValue",
    "ByteCount",
    "ByteSize",
    "CircuitBreaker",
    "Closeable",
    "FaultHooks",
    "ImmediateIndex",
    "JobLane",
    "LaneClosed",
    "LaneStore",
    "Priority",
    "RepeatedWarnings",
    "StoreJob",
    "by_chunk",
    "close_quietly",
    "did_you_mean",
    "fits_in_memory",
    "format_size",
    "host_and_port",
    "lazy_exports",
    "leading_chunks",
    "leading_failures",
    "load_hooks",
    "non_empty",
    "one_of",
    "parse_size",
    "probe_tcp",
    "seconds",
    "within",
    "word",
]
