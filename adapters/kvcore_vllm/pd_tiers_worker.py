"""The worker side of a connector that serves P/D and tiers at once: one report per request to vLLM.

The tiers' worker side and the P/D worker side run side by side on the rank's KV tensors, each with its
own part of the step's metadata (``PDTiersMetadata``). A request both owe something reaches vLLM once:
"finished receiving" when the tiers' load and the producer's pull have both ended, "finished sending"
when the tiers' saves are done and the producer's offer was freed. Failed blocks are each side's own;
their union is vLLM's load errors (vLLM recomputes from the first of them on).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from kvcore_vllm.metadata import KVCoreWorkerMetadata
from kvcore_vllm.pd_metadata import PDTiersMetadata
from kvcore_vllm.pd_worker import PDWorker
from kvcore_vllm.worker_side import WorkerSide

__all__ = ["PDTiersWorker"]


class PDTiersWorker:
    """The tiers' worker side of one KV-cache group and the P/D worker side of the same rank."""

    def __init__(self, tiers: WorkerSide, pd: PDWorker) -> None:
        self.tiers = tiers
        self.pd = pd
        # requests both sides owe a report, until the first one came: vLLM hears of them at the second
        self._owed_received: set[str] = set()
        self._owed_sent: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.tiers.register_kv_caches(kv_caches)
        self.pd.register_kv_caches(kv_caches)

    def handle_preemptions(self, meta: PDTiersMetadata) -> None:
        self.tiers.handle_preemptions(meta.tiers)

    def start_load_kv(self, meta: PDTiersMetadata) -> None:
        pulls = {r.request_id for r in meta.pd.receives if not r.is_release}
        self._owed_received.update(pulls.intersection(meta.tiers.receiving))
        self._owed_sent.update({o.request_id for o in meta.pd.offers}.intersection(meta.tiers.delayed))
        self.tiers.start_load_kv(meta.tiers)
        self.pd.start_load_kv(meta.pd)

    def wait_for_save(self, meta: PDTiersMetadata) -> None:
        self.tiers.wait_for_save(meta.tiers)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        tiers_sent, tiers_received = self.tiers.get_finished()
        self.tiers.take_failed_loads(tiers_received or ())  # one group: failures are told by block
        pd_sent, pd_received = self.pd.get_finished()
        sent = _once(self._owed_sent, tiers_sent, pd_sent)
        received = _once(self._owed_received, tiers_received, pd_received)
        return sent or None, received or None

    def take_load_errors(self) -> set[int]:
        return self.tiers.take_load_errors() | self.pd.take_load_errors()

    def build_worker_meta(self) -> KVCoreWorkerMetadata | None:
        return self.tiers.build_worker_meta()

    def shutdown(self) -> None:
        self.tiers.shutdown()
        self.pd.shutdown()


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
