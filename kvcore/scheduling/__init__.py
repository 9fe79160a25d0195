"""The scheduler side: decides everything, touches no KV byte. ``CacheScheduler`` is its façade for an
engine; each job it does has a module of its own."""

from __future__ import annotations

from kvcore.scheduling.scheduler import CacheScheduler, SchedulerStats

__all__ = ["CacheScheduler", "SchedulerStats"]
