"""The worker side: one ``BlockWorker`` per rank owns memory and executes the scheduler's ops through a
block mover and the remote tier; it decides nothing."""

from __future__ import annotations

from kvcore.execution.worker import FLUSH_TIMEOUT_S, BlockWorker

__all__ = ["FLUSH_TIMEOUT_S", "BlockWorker"]
