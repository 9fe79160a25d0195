"""The CPU backend's worker side: host memory for KV blocks and the block mover that fills and drains it.

``EngineKV`` registers the engine's KV tensors against their layout, ``HostMemory`` holds the host
blocks, and ``TorchBlockMover`` (the ``kvcore.ports.BlockMover`` port) copies whole blocks between them:
on a worker thread for a CPU engine, on copy streams for a CUDA engine. ``open_rank`` composes them
for one rank from kvcore's configuration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcore.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from kvcore_cpu.engine_kv import EngineKV
    from kvcore_cpu.host_memory import HostMemory
    from kvcore_cpu.mover import TorchBlockMover
    from kvcore_cpu.tier import open_rank

__all__ = ["EngineKV", "HostMemory", "TorchBlockMover", "open_rank"]

__getattr__ = lazy_exports(
    __name__,
    {
        "EngineKV": "kvcore_cpu.engine_kv",
        "HostMemory": "kvcore_cpu.host_memory",
        "TorchBlockMover": "kvcore_cpu.mover",
        "open_rank": "kvcore_cpu.tier",
    },
)
