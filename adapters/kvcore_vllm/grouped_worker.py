"""The worker side for a model of several KV-cache groups: one ``WorkerSide`` per group, over the group's
layers, run step by step together.

vLLM hears of a finished request once
every group that kept its blocks reported its saves done, and of an asynchronous load once every group
loading it reported it, with ``failed_recving`` when it failed in any group: vLLM takes load failures of
a model of several groups by request only (its block ids are not unique across groups), so every load
of such a model is asynchronous and a failed one is recomputed whole (a request waiting for its load
computes nothing meanwhile, so no save of a step reads over a failed load).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.errors import InvalidSpecError
from kvcore_vllm.metadata import GroupedMetadata, GroupedWorkerMetadata, KVCoreMetadata, KVCoreWorkerMetadata
from kvcore_vllm.worker_side import WorkerSide

__all__ = ["GroupedWorkerSide"]


class GroupedWorkerSide:
    """One ``WorkerSide`` per KV-cache group, in vLLM's group order."""

    def __init__(self, sides: Sequence[WorkerSide]) -> None:
        self.sides = tuple(sides)
        # request id -> the groups yet to report it: finished (saves done) / received (loads done)
        self._sending: dict[str, set[int]] = {}
        self._receiving: dict[str, set[int]] = {}
        self._failed: set[str] = set()  # requests whose load failed in a group, until every group reported

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for side in self.sides:
            side.register_kv_caches(kv_caches)

    def handle_preemptions(self, meta: GroupedMetadata) -> None:
        for side, group_meta in zip(self.sides, self._groups(meta), strict=True):
            side.handle_preemptions(group_meta)

    def start_load_kv(self, meta: GroupedMetadata) -> None:
        for n, (side, group_meta) in enumerate(zip(self.sides, self._groups(meta), strict=True)):
            for rid in group_meta.delayed:
                self._sending.setdefault(rid, set()).add(n)
            for rid in group_meta.receiving:
                self._receiving.setdefault(rid, set()).add(n)
            side.start_load_kv(group_meta)

    def wait_for_save(self, meta: GroupedMetadata) -> None:
        for side, group_meta in zip(self.sides, self._groups(meta), strict=True):
            side.wait_for_save(group_meta)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """Finished requests whose saves are done in every group, requests whose asynchronous loads are
        done in every group, and those of them whose load failed in any group (vLLM recomputes them:
        with several KV-cache groups it takes failures by request only, never by block)."""
        sent: set[str] = set()
        received: set[str] = set()
        for n, side in enumerate(self.sides):
            sending, receiving = side.get_finished()
            sent |= _reported(self._sending, n, sending or ())
            self._failed |= side.take_failed_loads(receiving or ())
            received |= _reported(self._receiving, n, receiving or ())
            side.take_load_errors()  # the blocks of those failures: told by request instead
        failed = self._failed & received
        self._failed -= failed
        self._failed &= self._receiving.keys()
        return sent, received, failed

    def build_worker_meta(self) -> GroupedWorkerMetadata | None:
        metas = [side.build_worker_meta() for side in self.sides]
        if all(meta is None for meta in metas):
            return None
        return GroupedWorkerMetadata(tuple(meta or KVCoreWorkerMetadata(()) for meta in metas))

    def shutdown(self) -> None:
        for side in self.sides:
            side.shutdown()

    def _groups(self, meta: GroupedMetadata) -> tuple[KVCoreMetadata, ...]:
        if len(meta.groups) != len(self.sides):
            raise InvalidSpecError(
                f"connector metadata: {len(meta.groups)} KV-cache groups, expected {len(self.sides)}"
            )
        return meta.groups


def _reported(waiting: dict[str, set[int]], group: int, done: set[str] | Sequence[str]) -> set[str]:
    """The requests of ``done`` (reported by ``group``) that no other group still has to report."""
    complete = set()
    for rid in done:
        groups = waiting.get(rid)
        if groups is None:
            continue
        groups.discard(group)
        if not groups:
            del waiting[rid]
            complete.add(rid)
    return complete
