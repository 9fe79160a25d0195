"""kvcore: move and reuse LLM KV cache across memory tiers, processes and machines.

This package exports what an engine needs: ``open_scheduler`` and ``open_worker`` (they compose any
installed backend), ``CacheScheduler`` and ``BlockWorker``, the step's values, ``EngineSpec`` and
``KVLayout``, ``ExtraKeys``, ``FaultHooks``, configuration and errors; and the ports a backend implements
(``kvcore.ports``), with ``JobBoard``/``JobResult`` for ``JobQueue``. A backend author builds on the ports,
``kvcore.kit`` and ``kvcore.plugins`` (docs/writing-a-backend.md says which names are stable).

The core is in rooms along its architecture (docs/architecture.md): ``model`` (what an engine is, the
step's messages), ``keying``, ``pool``, ``scheduling`` (decides; touches no byte), ``execution`` (moves
bytes; decides nothing), ``config``, ``plugins`` (the only place that knows both sides), ``kit`` and
``ports``; the top level holds the vocabulary (``errors``, ``ids``, ``checks``, ``jobs``). The modules'
old flat paths (``kvcore.scheduler``, ``kvcore.lane``, ...) still import for one release, with a
``DeprecationWarning`` naming the new one (``kvcore._moved``). The core imports the standard library,
attrs and cattrs only; the conformance suite for backend authors is ``kvcore.testing`` (imported on
demand, never from here).
"""

from __future__ import annotations

from kvcore import _moved
from kvcore.config import KVCoreConfig, config_to_dict, load_config, load_config_file, parse_size
from kvcore.errors import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    IncompatibleLayoutError,
    InvalidSpecError,
    KVCoreError,
    TransferFailed,
    TransferTimeout,
    UnsupportedConfiguration,
    UsageError,
)
from kvcore.execution.worker import BlockWorker
from kvcore.ids import ChunkKey, JobId, LookupId, RequestId
from kvcore.jobs import JobBoard, JobResult
from kvcore.keying.hashing import ExtraKeys, MMSpan
from kvcore.kit.faults import FaultHooks
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.step import BlockOp, OpReport, RemoteChunk, StepPlan
from kvcore.plugins.compose import open_scheduler, open_worker
from kvcore.ports import (
    BlockItem,
    BlockMover,
    BlockMovers,
    BlockRemote,
    BlockTransfer,
    ByteCopy,
    ChunkIndex,
    ChunkStore,
    Direction,
    HeldChunks,
    JobQueue,
    ManagedTier,
    MemoryRegion,
    OrderedMover,
    PeerTransport,
    RankMemory,
    RemoteTier,
    StoreItem,
    SupportsAdoptedLocks,
    SupportsBlockTransfer,
    SupportsClear,
    SupportsHeldLookups,
    SupportsImmediateLookup,
    SupportsReopen,
    SupportsTierUsage,
    TierUsage,
)
from kvcore.scheduling.scheduler import CacheScheduler, SchedulerStats

_moved.install()

__version__ = "0.1.0"
__all__ = [
    "BackendError",
    "BackendUnavailable",
    "BlockItem",
    "BlockMover",
    "BlockMovers",
    "BlockOp",
    "BlockRemote",
    "BlockTransfer",
    "BlockWorker",
    "ByteCopy",
    "CacheScheduler",
    "ChunkIndex",
    "ChunkKey",
    "ChunkStore",
    "ConfigError",
    "Direction",
    "HeldChunks",
    "EngineSpec",
    "ExtraKeys",
    "FaultHooks",
    "HeadOrder",
    "IncompatibleLayoutError",
    "InvalidSpecError",
    "JobBoard",
    "JobId",
    "JobQueue",
    "JobResult",
    "KVCoreConfig",
    "KVCoreError",
    "KVLayout",
    "LayoutKind",
    "LookupId",
    "MMSpan",
    "ManagedTier",
    "MemoryRegion",
    "OpReport",
    "OrderedMover",
    "PeerTransport",
    "RankMemory",
    "RemoteChunk",
    "RemoteTier",
    "RequestId",
    "SchedulerStats",
    "StepPlan",
    "StoreItem",
    "SupportsAdoptedLocks",
    "SupportsBlockTransfer",
    "SupportsClear",
    "SupportsHeldLookups",
    "SupportsImmediateLookup",
    "SupportsReopen",
    "SupportsTierUsage",
    "TierUsage",
    "TransferFailed",
    "TransferTimeout",
    "UnsupportedConfiguration",
    "UsageError",
    "config_to_dict",
    "load_config",
    "load_config_file",
    "open_scheduler",
    "open_worker",
    "parse_size",
]
