"""kvcore: move and reuse LLM KV cache across memory tiers, processes and machines.

This package exports the public API only: what an engine needs (``open_scheduler`` and ``open_worker``,
which compose any installed backend, ``CacheScheduler``, ``BlockWorker``, the plan values, ``EngineSpec``
and ``KVLayout``, ``ExtraKeys``, ``FaultHooks``, configuration and errors) and what a backend implements
(the ports of ``kvcore.ports``, with ``JobBoard``/``JobResult`` to implement ``JobQueue``). Everything
else — hashing, keys, the block pool, load specs, TP transfer plans, the lifecycle — stays importable from
its own module (``kvcore.keying.keys``, ``kvcore.pool.block_pool``, ...) and may change. The core imports the standard
library, attrs and cattrs only; the conformance suite for backend authors is ``kvcore.testing`` (imported
on demand, never from here).
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
