"""kvcore: move and reuse LLM KV cache across memory tiers, processes and machines.

The domain core: chunk hashing, content-addressed keys, prefix lookup, load specs, an LRU/ARC block pool,
heterogeneous-TP transfer plans, the request lifecycle, the scheduler/worker facade for engines, and the
ports (``kvcore.ports``) that backends implement. It imports the standard library, attrs and cattrs only;
the conformance suite for backend authors is ``kvcore.testing`` (imported on demand, never from here).
"""

from __future__ import annotations

from kvcore.block_pool import BlockPool, PoolEvent, PoolEventKind, PoolUsage, StorePlan
from kvcore.config import (
    BackendConfig,
    ByteSize,
    CPUBackendConfig,
    KVCoreConfig,
    config_to_dict,
    load_config,
    load_config_file,
    parse_size,
)
from kvcore.engine import EngineSpec
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
from kvcore.eviction import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy
from kvcore.hashing import (
    DEFAULT_CHUNK_TOKENS,
    NO_EXTRA,
    ChunkHasher,
    ExtraKeys,
    HashAlgorithm,
    MMSpan,
    PartialChunkPolicy,
    regroup_block_hashes,
)
from kvcore.health import CircuitBreaker
from kvcore.ids import ChunkKey, JobId, LookupId, RequestId
from kvcore.jobs import JobBoard, JobResult
from kvcore.keys import Keyspace, Namespace, Shard, writes
from kvcore.layout import ByteRange, HeadOrder, KVLayout, LayoutKind
from kvcore.lifecycle import JobRecord, JobRole, Phase, RequestTable, RequestTracker
from kvcore.load_spec import ChunkPiece, LoadSpec, hit_tokens, plan_load
from kvcore.lookup import PendingLookup, PrefixLookup, leading_complete
from kvcore.plan import BlockOp, OpReport, StepPlan
from kvcore.ports import (
    BlockItem,
    BlockMover,
    BlockTransfer,
    ByteCopy,
    ChunkIndex,
    ChunkStore,
    Direction,
    JobQueue,
    ManagedTier,
    MemoryRegion,
    OrderedMover,
    PeerTransport,
    StoreItem,
    SupportsBlockTransfer,
    SupportsClear,
    SupportsImmediateLookup,
)
from kvcore.scheduler import CacheScheduler, SchedulerStats
from kvcore.transfer_plan import CopyColumns, RangeCopy, RankPairPlan, TPSide, TransferPlan, plan_transfer
from kvcore.worker import BlockWorker

__version__ = "0.1.0"
__all__ = [
    "ARCPolicy",
    "BackendConfig",
    "BackendError",
    "BackendUnavailable",
    "BlockItem",
    "BlockMover",
    "BlockOp",
    "BlockPool",
    "BlockTransfer",
    "BlockWorker",
    "ByteCopy",
    "ByteRange",
    "ByteSize",
    "CPUBackendConfig",
    "CacheScheduler",
    "ChunkHasher",
    "ChunkIndex",
    "ChunkKey",
    "ChunkPiece",
    "ChunkStore",
    "CircuitBreaker",
    "ConfigError",
    "CopyColumns",
    "DEFAULT_CHUNK_TOKENS",
    "Direction",
    "EngineSpec",
    "EvictionPolicy",
    "ExtraKeys",
    "HashAlgorithm",
    "HeadOrder",
    "IncompatibleLayoutError",
    "InvalidSpecError",
    "JobBoard",
    "JobId",
    "JobQueue",
    "JobRecord",
    "JobResult",
    "JobRole",
    "KVCoreConfig",
    "KVCoreError",
    "KVLayout",
    "Keyspace",
    "LRUPolicy",
    "LayoutKind",
    "LoadSpec",
    "LookupId",
    "MMSpan",
    "ManagedTier",
    "MemoryRegion",
    "NO_EXTRA",
    "Namespace",
    "OpReport",
    "OrderedMover",
    "PartialChunkPolicy",
    "PeerTransport",
    "PendingLookup",
    "Phase",
    "PoolEvent",
    "PoolEventKind",
    "PoolUsage",
    "PrefixLookup",
    "RangeCopy",
    "RankPairPlan",
    "RequestId",
    "RequestTable",
    "RequestTracker",
    "SchedulerStats",
    "Shard",
    "StepPlan",
    "StoreItem",
    "StorePlan",
    "SupportsBlockTransfer",
    "SupportsClear",
    "SupportsImmediateLookup",
    "TPSide",
    "TransferFailed",
    "TransferPlan",
    "TransferTimeout",
    "UnsupportedConfiguration",
    "UsageError",
    "config_to_dict",
    "hit_tokens",
    "leading_complete",
    "load_config",
    "load_config_file",
    "make_policy",
    "parse_size",
    "plan_load",
    "plan_transfer",
    "regroup_block_hashes",
    "writes",
]
