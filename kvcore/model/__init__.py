"""The model of what kvcore serves: an engine (``EngineSpec``), the byte layout of its KV (``KVLayout``),
the byte ranges each rank sends each other rank under heterogeneous TP (``transfer_plan``; for recurrent
states, which split in parts: ``state_plan``), and the messages of a step between the scheduler side and
the workers (``step``: ``StepPlan``, ``BlockOp``, ``OpReport``). Values only: nothing here decides or moves
a byte."""

from __future__ import annotations

from kvcore.model.engine import KV_DTYPE_SIZES, EngineSpec
from kvcore.model.layout import ByteRange, HeadOrder, KVLayout, LayoutKind
from kvcore.model.state_plan import StateLayout, StatePart
from kvcore.model.step import BlockOp, OpReport, RemoteChunk, StepPlan

__all__ = [
    "KV_DTYPE_SIZES",
    "BlockOp",
    "ByteRange",
    "EngineSpec",
    "HeadOrder",
    "KVLayout",
    "LayoutKind",
    "OpReport",
    "RemoteChunk",
    "StateLayout",
    "StatePart",
    "StepPlan",
]
