"""What crosses between vLLM's processes each step: the scheduler's plan to the workers, reports back.

Both are frozen attrs values that pickle (vLLM sends ``KVConnectorMetadata`` from the engine-core process
to every worker, and aggregates worker metadata across ranks).
"""

from __future__ import annotations

from attrs import field, frozen
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvcore.model.step import OpReport, StepPlan

__all__ = ["GroupedMetadata", "GroupedWorkerMetadata", "KVCoreMetadata", "KVCoreWorkerMetadata"]


@frozen
class KVCoreMetadata(KVConnectorMetadata):
    """One step's instructions for every worker. ``plan.fenced`` (and ``evictions.fenced``) name the
    copies of preempted requests, to be fenced before vLLM reuses their blocks.

    ``delayed``: finished requests whose blocks vLLM keeps until each worker reports them done.
    ``failed_blocks``: engine blocks the scheduler could not load (chunks gone since the lookup).
    ``evictions``: saves of blocks vLLM evicted in this step (lazy store policy): they must be done
    before the forward pass or any load writes those blocks.
    ``receiving``: requests whose loads of this step are asynchronous (maybe none left to copy): each
    worker reports them in ``get_finished`` once their loads are done, and awaits none of them.
    ``reused``: blocks of a sliding-window group handed to a request in this step, which vLLM may have
    freed from another request's window since that request's saves were sent: a save still reading one
    is waited for (or dropped) before the forward pass writes it.
    ``failed_requests``: asynchronous loads the scheduler gave up before any copy (its chunks gone, or a
    reset made them stale), where failures are told by request (a model of several KV-cache groups).
    """

    plan: StepPlan
    delayed: tuple[str, ...] = ()
    failed_blocks: tuple[int, ...] = ()
    evictions: StepPlan = field(factory=lambda: StepPlan(()))
    receiving: tuple[str, ...] = ()
    reused: tuple[int, ...] = ()
    failed_requests: tuple[str, ...] = ()


@frozen
class KVCoreWorkerMetadata(KVConnectorWorkerMetadata):
    """The op reports of one step, from one worker or (aggregated) from all of them, and the ranks whose
    copies are halted (``BlockWorker.halt``: every op of theirs fails meanwhile), told with every report,
    and those whose copies resumed (``BlockWorker.resume``) in this step."""

    reports: tuple[OpReport, ...]
    halted_ranks: tuple[int, ...] = ()
    resumed_ranks: tuple[int, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVCoreWorkerMetadata):
            return self
        return KVCoreWorkerMetadata(
            self.reports + other.reports,
            self.halted_ranks + other.halted_ranks,
            self.resumed_ranks + other.resumed_ranks,
        )


@frozen
class GroupedMetadata(KVConnectorMetadata):
    """One step's instructions for a model of several KV-cache groups: one ``KVCoreMetadata`` per group,
    in vLLM's group order."""

    groups: tuple[KVCoreMetadata, ...]


@frozen
class GroupedWorkerMetadata(KVConnectorWorkerMetadata):
    """The reports of one step for a model of several KV-cache groups: one ``KVCoreWorkerMetadata`` per
    group, in vLLM's group order, aggregated group by group across ranks."""

    groups: tuple[KVCoreWorkerMetadata, ...]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, GroupedWorkerMetadata) or len(other.groups) != len(self.groups):
            return self
        merged = (mine.aggregate(theirs) for mine, theirs in zip(self.groups, other.groups, strict=True))
        return GroupedWorkerMetadata(tuple(m for m in merged if isinstance(m, KVCoreWorkerMetadata)))
