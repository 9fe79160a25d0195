"""The worker side of a connector that serves P/D and tiers at once: one report per request to vLLM.

The tiers' worker side and the P/D worker side run side by side on the rank's KV tensors, each with its
own part of the step's metadata (``PDTiersMetadata``). A request both owe something reaches vLLM once:
"finished receiving" when the tiers' load and the producer's pull have both ended, "finished sending"
when the tiers' saves are done and the producer's offer was freed. Failed blocks are each side's own;
their union is vLLM's load errors (vLLM recomputes from the first of them on). With a hybrid model's
groups (the tiers' ``GroupedWorkerSide``) vLLM takes failures by request: a request whose load failed in
either side is named failed with its one report, and vLLM recomputes it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from kvcore.errors import InvalidSpecError
from kvcore_vllm.grouped_worker import GroupedWorkerSide
from kvcore_vllm.metadata import GroupedMetadata, GroupedWorkerMetadata, KVCoreMetadata, KVCoreWorkerMetadata
from kvcore_vllm.pd_metadata import PDTiersMetadata
from kvcore_vllm.pd_worker import PDWorker
from kvcore_vllm.worker_side import WorkerSide

__all__ = ["PDTiersWorker"]


class PDTiersWorker:
    """The tiers' worker side (of one KV-cache group, or of several) and the P/D worker side of the same
    rank."""

    def __init__(self, tiers: WorkerSide | GroupedWorkerSide, pd: PDWorker) -> None:
        self.tiers = tiers
        self.pd = pd
        # requests both sides owe a report, until the first one came: vLLM hears of them at the second
        self._owed_received: set[str] = set()
        self._owed_sent: set[str] = set()
        self._failed: set[str] = set()  # several groups: requests failed in a side, until reported received

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.tiers.register_kv_caches(kv_caches)
        self.pd.register_kv_caches(kv_caches)

    def handle_preemptions(self, meta: PDTiersMetadata) -> None:
        if isinstance(self.tiers, GroupedWorkerSide):
            self.tiers.handle_preemptions(_grouped(meta))
        else:
            self.tiers.handle_preemptions(_single(meta))

    def start_load_kv(self, meta: PDTiersMetadata) -> None:
        tiers = _grouped(meta).groups if isinstance(self.tiers, GroupedWorkerSide) else (_single(meta),)
        loading = {rid for group in tiers for rid in group.receiving}
        saving = {rid for group in tiers for rid in group.delayed}
        pulls = {r.request_id for r in meta.pd.receives if not r.is_release}
        self._owed_received.update(pulls & loading)
        self._owed_sent.update({o.request_id for o in meta.pd.offers} & saving)
        if isinstance(self.tiers, GroupedWorkerSide):
            self.tiers.start_load_kv(_grouped(meta))
        else:
            self.tiers.start_load_kv(_single(meta))
        self.pd.start_load_kv(meta.pd)

    def wait_for_save(self, meta: PDTiersMetadata) -> None:
        if isinstance(self.tiers, GroupedWorkerSide):
            self.tiers.wait_for_save(_grouped(meta))
        else:
            self.tiers.wait_for_save(_single(meta))

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """Requests finished sending and receiving in every side that owed them a report, and (several
        groups) those of the received whose load failed in either side; with one group failures are told
        by block (``take_load_errors``)."""
        if isinstance(self.tiers, GroupedWorkerSide):
            tiers_sent, tiers_received, tiers_failed = self.tiers.transfer_results()
        else:
            sending, receiving = self.tiers.get_finished()
            tiers_sent, tiers_received, tiers_failed = set(sending or ()), set(receiving or ()), set()
            self.tiers.take_failed_loads(tiers_received)  # one group: failures are told by block
        pd_sent, pd_received = self.pd.get_finished()
        sent = _once(self._owed_sent, tiers_sent, pd_sent)
        received = _once(self._owed_received, tiers_received, pd_received)
        if not isinstance(self.tiers, GroupedWorkerSide):
            self.pd.take_failed()  # one group: failures are told by block
            return sent, received, set()
        self._failed |= tiers_failed | self.pd.take_failed()
        failed = self._failed & received
        self._failed -= failed
        return sent, received, failed

    def take_load_errors(self) -> set[int]:
        errors = self.pd.take_load_errors()
        if isinstance(self.tiers, GroupedWorkerSide):
            return set()  # told by request
        return self.tiers.take_load_errors() | errors

    def build_worker_meta(self) -> KVCoreWorkerMetadata | GroupedWorkerMetadata | None:
        return self.tiers.build_worker_meta()

    def shutdown(self) -> None:
        self.tiers.shutdown()
        self.pd.shutdown()


def _grouped(meta: PDTiersMetadata) -> GroupedMetadata:
    if not isinstance(meta.tiers, GroupedMetadata):
        raise InvalidSpecError(
            f"connector metadata: the tiers' part is {type(meta.tiers).__name__}, expected groups"
        )
    return meta.tiers


def _single(meta: PDTiersMetadata) -> KVCoreMetadata:
    if not isinstance(meta.tiers, KVCoreMetadata):
        raise InvalidSpecError(
            f"connector metadata: the tiers' part is {type(meta.tiers).__name__}, expected one group"
        )
    return meta.tiers


def _once(owed: set[str], *reports: Iterable[str] | None) -> set[str]:
    """The requests whose last owed report came now: one owed by both sides is held back (and dropped
    from ``owed``) at its first report; the second, even in the same step, lets it through."""
    counts = Counter(rid for report in reports for rid in report or ())
    done: set[str] = set()
    for rid, count in counts.items():
        if rid in owed:
            owed.discard(rid)
            if count < 2:
                continue
        done.add(rid)
    return done
