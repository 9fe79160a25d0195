"""Block pool: microseconds per block for a full cycle, kvcore (LRU and ARC) against vLLM's ``BlockPool``.

One cycle per batch of blocks, the way a connector drives the pool: look up a batch of hot chunks and
touch them, then store a batch of new chunks into the full pool (prepare + complete), each evicting one.
The pool starts full: half hot chunks (touched round-robin, so they stay), half cold ones. vLLM runs the
same cycle in its own terms (``get_cached_block``, ``touch`` + ``free_blocks``, ``get_new_blocks``,
``cache_full_blocks`` + ``free_blocks``) when it is importable; a plain ``OrderedDict`` doing only the
dictionary work of a cycle gives the floor. Ratios are taken in the same run.

    python benchmarks/bench_pool.py [--quick] [--slots N]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import inspect
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from attrs import frozen

from kvcore.ids import ChunkKey
from kvcore.pool.block_pool import BlockPool
from kvcore.pool.eviction import make_policy

BLOCK_TOKENS = 16  # only vLLM needs it; any value works


@frozen
class Workload:
    """The key streams every implementation runs through; ``hot`` batches repeat round-robin."""

    slots: int
    batch: int
    hot: tuple[ChunkKey, ...]
    cold: tuple[ChunkKey, ...]
    hot_batches: tuple[tuple[ChunkKey, ...], ...]
    new_batches: tuple[tuple[ChunkKey, ...], ...]

    @classmethod
    def build(cls, slots: int, batch: int, blocks: int) -> Workload:
        names = iter(_keys(slots + blocks))
        hot = tuple(next(names) for _ in range(slots // 2))
        cold = tuple(next(names) for _ in range(slots - len(hot)))
        fresh = tuple(names)
        return cls(
            slots=slots,
            batch=batch,
            hot=hot,
            cold=cold,
            hot_batches=_batches(hot, batch),
            new_batches=_batches(fresh[: blocks - blocks % batch], batch),
        )

    @property
    def blocks(self) -> int:
        return len(self.new_batches) * self.batch


def _keys(count: int) -> list[ChunkKey]:
    # Shaped like real chunk keys: namespace digest / shard / chunk hash.
    return [
        ChunkKey(f"ns0123456789abcdef/L0-32:H0-8/{hashlib.blake2b(b'%d' % i).hexdigest()[:32]}")
        for i in range(count)
    ]


def _batches(keys: tuple[ChunkKey, ...], size: int) -> tuple[tuple[ChunkKey, ...], ...]:
    return tuple(keys[i : i + size] for i in range(0, len(keys) - size + 1, size))


def _timed(loop: Callable[[], int], expected_hits: int, name: str) -> float:
    """Seconds that ``loop`` takes, with the collector off; checks that every lookup hit."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        hits = loop()
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    if hits != expected_hits:
        raise RuntimeError(f"{name}: {hits} lookup hits, expected {expected_hits}: the workload is wrong")
    return elapsed


# -- the implementations ------------------------------------------------------------------------------


def run_kvcore(w: Workload, policy: str, events: bool) -> float:
    pool = BlockPool(w.slots, make_policy(policy, w.slots), record_events=events)
    for keys in (w.hot, w.cold):
        pool.prepare_store(keys)
        pool.complete_store(keys, success=True)
    pool.touch(w.hot)
    pool.take_events()
    lookup, touch, prepare, complete, take = (
        pool.lookup,
        pool.touch,
        pool.prepare_store,
        pool.complete_store,
        pool.take_events,
    )
    hot_batches, rounds = w.hot_batches, len(w.hot_batches)

    def loop() -> int:
        total = 0
        for i, new in enumerate(w.new_batches):
            hot = hot_batches[i % rounds]
            hits = lookup(hot)
            touch(hot[:hits])
            prepare(new)
            complete(new, True)
            take()
            total += hits
        return total

    elapsed = _timed(loop, w.blocks, f"kvcore {policy}")
    if pool.usage().evictions != w.blocks:
        raise RuntimeError(f"kvcore {policy}: {pool.usage().evictions} evictions, expected {w.blocks}")
    return elapsed


def run_floor(w: Workload) -> float:
    """Only the dictionary work of a cycle: membership, move to end, pop the oldest, insert."""
    order: OrderedDict[ChunkKey, int] = OrderedDict((key, slot) for slot, key in enumerate(w.hot + w.cold))
    for key in w.hot:
        order.move_to_end(key)
    hot_batches, rounds = w.hot_batches, len(w.hot_batches)
    move, pop = order.move_to_end, order.popitem

    def loop() -> int:
        total = 0
        for i, new in enumerate(w.new_batches):
            hot = hot_batches[i % rounds]
            hits = 0
            for key in hot:
                if key not in order:
                    break
                hits += 1
            for key in hot[:hits]:
                move(key)
            for key in new:
                order[key] = pop(last=False)[1]
            total += hits
        return total

    return _timed(loop, w.blocks, "floor")


class _Request:
    """The one attribute of ``vllm.v1.request.Request`` that ``cache_full_blocks`` reads."""

    __slots__ = ("block_hashes",)

    def __init__(self) -> None:
        self.block_hashes: list[bytes] = []


def load_vllm() -> tuple[Any, str] | str:
    """vLLM's ``BlockPool`` class and version, or why the baseline is skipped. Imports vLLM lazily."""
    try:
        module = importlib.import_module("vllm.v1.core.block_pool")
    except ImportError:
        return "vLLM not installed: baseline skipped"
    version = str(getattr(importlib.import_module("vllm"), "__version__", "(version unknown)"))
    try:
        run_vllm(module.BlockPool, Workload.build(slots=64, batch=4, blocks=64))
    except (TypeError, AttributeError) as exc:
        return f"vLLM {version}: BlockPool API not the one of 0.11+ ({exc}): baseline skipped"
    return module.BlockPool, version


def run_vllm(pool_class: Any, w: Workload) -> float:
    # vLLM's block pool and its blocks are untyped here: Any stops at this function.
    options: dict[str, Any] = {"num_gpu_blocks": w.slots + 1, "enable_caching": True}  # + its null block
    if "hash_block_size" in inspect.signature(pool_class).parameters:
        options["hash_block_size"] = BLOCK_TOKENS
    pool: Any = pool_class(**options)
    request = _Request()

    def store(hashes: list[bytes]) -> None:
        blocks = pool.get_new_blocks(len(hashes))
        request.block_hashes = hashes
        pool.cache_full_blocks(
            request=request,
            blocks=blocks,
            num_cached_blocks=0,
            num_full_blocks=len(hashes),
            block_size=BLOCK_TOKENS,
            kv_cache_group_id=0,
        )
        pool.free_blocks(blocks)

    groups = [0]
    touch = _vllm_touch(pool)
    hot = [key.encode() for key in w.hot]
    store(hot)
    store([key.encode() for key in w.cold])
    hot_blocks = [pool.get_cached_block(h, groups)[0] for h in hot]
    touch(hot_blocks)
    pool.free_blocks(hot_blocks)
    hot_batches = [[key.encode() for key in keys] for keys in w.hot_batches]
    new_batches = [[key.encode() for key in keys] for keys in w.new_batches]
    rounds = len(hot_batches)
    get_cached, free = pool.get_cached_block, pool.free_blocks

    def loop() -> int:
        total = 0
        for i, new in enumerate(new_batches):
            found = []
            for h in hot_batches[i % rounds]:
                blocks = get_cached(h, groups)
                if blocks is None:
                    break
                found.append(blocks[0])
            touch(found)
            free(found)
            store(new)
            total += len(found)
        return total

    return _timed(loop, w.blocks, "vLLM")


def _vllm_touch(pool: Any) -> Callable[[list[Any]], None]:
    """``touch`` takes a flat list of blocks in recent vLLM, one list per KV-cache group before."""
    probe = pool.get_new_blocks(1)
    try:
        pool.touch(probe)
        flat = True
    except TypeError:  # iterating a block: the per-group form
        pool.touch((probe,))
        flat = False
    pool.free_blocks(probe)
    pool.free_blocks(probe)
    if flat:
        touch: Callable[[list[Any]], None] = pool.touch
        return touch
    return lambda blocks: pool.touch((blocks,))


# -- the table ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a run of a few seconds")
    parser.add_argument("--slots", type=int, default=100_000, help="pool size (default 100000)")
    args = parser.parse_args(argv)
    # (batch size, blocks per run): one block per call is where per-call costs show
    runs, repeats = ([(32, 20_000)], 1) if args.quick else ([(1, 30_000), (32, 100_000)], 5)

    # kvcore records no events here, as vLLM's pool by default; "+ events" shows what they cost
    impls: dict[str, Callable[[Workload], float]] = {
        "floor (OrderedDict)": run_floor,
        "kvcore lru": lambda w: run_kvcore(w, "lru", events=False),
        "kvcore arc": lambda w: run_kvcore(w, "arc", events=False),
        "kvcore lru + events": lambda w: run_kvcore(w, "lru", events=True),
    }
    vllm = load_vllm()
    baseline = None
    if isinstance(vllm, str):
        print(vllm)
    else:
        pool_class, version = vllm
        baseline = f"vLLM {version}"
        impls[baseline] = lambda w: run_vllm(pool_class, w)

    print(f"block pool, {args.slots} slots: us per block of a full cycle (lookup, touch, store, evict)")
    print(f"median of {repeats} interleaved run(s); ratios from this run")
    print(f"{'batch':>5}  {'implementation':<22}{'us/block':>9}{'vs floor':>10}{'vs vLLM':>9}")
    for batch, blocks in runs:
        workload = Workload.build(args.slots, batch, blocks)
        times: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(repeats):
            for name, run in impls.items():
                times[name].append(run(workload) * 1e6 / workload.blocks)
        us = {name: statistics.median(values) for name, values in times.items()}
        for name, value in us.items():
            versus = f"{value / us[baseline]:8.2f}x" if baseline else f"{'-':>9}"
            print(f"{batch:>5}  {name:<22}{value:9.3f}{value / us['floor (OrderedDict)']:9.2f}x{versus}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
