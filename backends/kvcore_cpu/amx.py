"""Claiming the CPU's AMX tile state before a backend starts native threads.

vLLM's CPU attention uses AMX on CPUs that have it, and PyTorch requests the permission lazily, at the
first such kernel. Linux refuses it once a thread with a small signal stack exists (Mooncake's client and
transfer-engine threads are such threads), and the kernel then dies with SIGILL. Claiming it before those
threads start keeps the engine computing next to them.
"""

from __future__ import annotations

import torch

__all__ = ["claim_amx"]


def claim_amx() -> None:
    """Request AMX tile permission for this process now, if the CPU has AMX (idempotent)."""
    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()
