"""The CPU tier's registrations: the ``cpu`` backend (``kvcore.backends``) and torch's engine memory
(``kvcore.engine_memory``), which every backend's worker side runs on when the engine's KV is in torch
tensors. Importing this module imports neither torch nor the rest of the package: the registry loads it
to read any config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcore.config import KVCoreConfig
from kvcore.errors import InvalidSpecError
from kvcore.model.engine import EngineSpec
from kvcore.plugins import RemotePort
from kvcore.ports import ChunkIndex, RankMemory
from kvcore_cpu.config import CPUBackendConfig

if TYPE_CHECKING:
    from kvcore.execution.worker import BlockWorker
    from kvcore.kit.faults import FaultHooks
    from kvcore.plugins import MoverWrap, RemoteOpener

__all__ = ["BACKEND", "TORCH", "CPUBackend", "TorchMemory"]


class CPUBackend:
    """``{"kind": "cpu", "size": ...}``: the host pool alone, indexed by the scheduler; no remote tier."""

    kind = "cpu"
    config_class = CPUBackendConfig

    def open_index(self, config: KVCoreConfig, engine: EngineSpec) -> ChunkIndex | None:
        return None

    def open_remote(self, config: KVCoreConfig, engine: EngineSpec, memory: RankMemory) -> RemotePort | None:
        return None


class TorchMemory:
    """Engine KV in torch tensors (CPU or CUDA), a host pool in (page-locked) host memory, copies by
    ``TorchBlockMover``: ``kvcore_cpu.tier.open_rank``."""

    name = "torch"

    def accepts(self, tensors: Sequence[object]) -> bool:
        import torch  # only when a worker is opened

        return bool(tensors) and all(isinstance(t, torch.Tensor) for t in tensors)

    def open_rank(
        self,
        config: KVCoreConfig,
        engine: EngineSpec,
        tensors: Sequence[object],
        *,
        rank: int,
        remote: RemoteOpener,
        faults: FaultHooks | None = None,
        mover: MoverWrap | None = None,
    ) -> BlockWorker:
        import torch

        from kvcore_cpu.tier import open_rank

        kv: list[torch.Tensor] = []
        for i, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise InvalidSpecError(f"tensors[{i}]: got {type(tensor).__name__}, expected a torch.Tensor")
            kv.append(tensor)
        world = engine.tp_size
        return open_rank(
            config, engine, kv, rank=rank, world_size=world, remote=remote, faults=faults, mover=mover
        )


BACKEND = CPUBackend()
TORCH = TorchMemory()
