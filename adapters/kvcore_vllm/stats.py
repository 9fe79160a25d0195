"""Connector statistics in vLLM's ``KVConnectorStats`` form: counters that add up across ranks and steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["KVCoreStats"]


@dataclass
class KVCoreStats(KVConnectorStats):
    """``data`` maps counter names (lookups, hit tokens, loaded/saved blocks, failures, pool usage) to ints."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: value for key, value in self.data.items() if isinstance(value, int | float)}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    @classmethod
    def of(cls, data: dict[str, Any]) -> KVCoreStats:
        return cls(data=dict(data))
