"""The vLLM adapter's composition root: the one module of the adapter that names a backend.

It turns the validated config into the scheduler-side core and each rank's worker. Today the only
backend is the CPU tier; others plug in here, by the config's ``backend.kind``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.config import KVCoreConfig
from kvcore.engine import EngineSpec
from kvcore.scheduler import CacheScheduler
from kvcore_cpu.tier import CPUWorker, open_worker, pool_slots

__all__ = ["RankWorker", "open_rank_worker", "scheduler_core"]

RankWorker = CPUWorker


def scheduler_core(config: KVCoreConfig, engine: EngineSpec, hash_identity: str) -> CacheScheduler:
    world = engine.tp_size
    slots = pool_slots(config, engine, world)
    return CacheScheduler(config, engine, slots, world_size=world, hash_identity=hash_identity)


def open_rank_worker(
    config: KVCoreConfig, engine: EngineSpec, tensors: Sequence[torch.Tensor], rank: int
) -> RankWorker:
    return open_worker(config, engine, tensors, rank=rank, world_size=engine.tp_size)
