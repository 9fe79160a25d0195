"""What a step's tensor-parallel ranks agree on before their saves: which requests' synchronous loads
failed on any rank.

A load that fails on one rank only leaves the forward pass wrong on every rank (the all-reduce after
attention mixes that rank's heads into every rank's hidden states), so no rank may save what that step
computed for the request: a rank whose own load succeeded would otherwise publish a wrong shard to a
shared tier, where it stays (a store keeps a key's first value) and completes the chunk once the other
ranks' shards arrive. Every rank runs the same step's loads from the same metadata, so each asks with
the same requests in the same order, and one all-reduce over the ranks' CPU group answers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence, Set
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["RankAgreement", "alone", "over_group"]

log = logging.getLogger(__name__)

RankAgreement = Callable[[Sequence[str], Set[str]], set[str]]
"""``agree(requests, failed)``: of the step's synchronous-load ``requests`` (the same, in the same order,
on every rank), those whose load failed on any rank, given those that failed on this one."""


def alone(requests: Sequence[str], failed: Set[str]) -> set[str]:
    """The agreement of a single rank: its own failures."""
    return set(failed)


def over_group(group: dist.ProcessGroup, timeout_s: float) -> RankAgreement:
    """The agreement of the ranks of ``group`` (a CPU process group: vLLM's TP group's ``cpu_group``),
    waited for at most ``timeout_s``; a collective that fails or times out counts every request as
    failed (their saves of the step are dropped, never published wrong)."""

    def agree(requests: Sequence[str], failed: Set[str]) -> set[str]:
        if not requests:
            return set()
        flags = torch.tensor([r in failed for r in requests], dtype=torch.uint8)
        try:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
            if work is None or not work.wait(timeout=timedelta(seconds=timeout_s)):
                raise RuntimeError("the all-reduce did not complete")
        except RuntimeError as exc:
            log.warning("kvcore: ranks could not agree on the step's failed loads (%s); saving none", exc)
            return set(requests)
        return {r for r, flag in zip(requests, flags.tolist(), strict=True) if flag}

    return agree
