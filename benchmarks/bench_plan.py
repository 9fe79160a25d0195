"""Transfer-plan cost for large layouts: planning, materializing a request's ranges, and coalescing.

The baseline, measured in the same run, is the naive expansion a plan without coalescing would do: every
template copy shifted per block into a list of (src, dst, length) tuples. ``materialize_columns`` is the
hot path (what batched copy APIs take); ``materialize`` adds one ``RangeCopy`` object per range.
Timings are per consumer rank 0 (every pair it reads) and are offsets within one layer: the same ranges
serve all layers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.transfer_plan import RangeCopy, TPSide, TransferPlan, plan_transfer

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS, DTYPE_SIZE, ALLOCATED_BLOCKS = 64, 32, 128, 16, 2, 16384


def _side(tp: int, kind: LayoutKind) -> TPSide:
    layout = KVLayout(
        kind, ALLOCATED_BLOCKS, BLOCK_TOKENS, KV_HEADS // tp, HEAD_SIZE, DTYPE_SIZE, HeadOrder.HND
    )
    return TPSide(tp, layout, KV_HEADS, LAYERS)


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def _naive(plan: TransferPlan, src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    src_stride, dst_stride = plan.producer.layout.block_stride, plan.consumer.layout.block_stride
    return [
        (c.src_offset + s * src_stride, c.dst_offset + d * dst_stride, c.length)
        for pair in plan.pairs_for_consumer(0)
        for s, d in zip(src, dst, strict=True)
        for c in pair.block_copies
    ]


def _columns(plan: TransferPlan, src: Sequence[int], dst: Sequence[int]) -> int:
    return sum(len(plan.materialize_columns(pair, src, dst)) for pair in plan.pairs_for_consumer(0))


def _objects(plan: TransferPlan, src: Sequence[int], dst: Sequence[int]) -> list[RangeCopy]:
    return [copy for pair in plan.pairs_for_consumer(0) for copy in plan.materialize(pair, src, dst)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer blocks and repeats (a few seconds)")
    parser.add_argument("--blocks", type=int, default=4096, help="blocks in the request")
    args = parser.parse_args(argv)
    blocks = 512 if args.quick else args.blocks
    repeats = 5 if args.quick else 21
    rng = random.Random(0)
    orders = {
        "consecutive": (list(range(100, 100 + blocks)), list(range(3000, 3000 + blocks))),
        "shuffled": (
            rng.sample(range(ALLOCATED_BLOCKS), blocks),
            rng.sample(range(ALLOCATED_BLOCKS), blocks),
        ),
    }
    print(
        f"{LAYERS} layers, {KV_HEADS} KV heads x {HEAD_SIZE}, {BLOCK_TOKENS}-token blocks, HND, "
        f"{blocks} request blocks; materialize = consumer rank 0, one layer's offsets (all layers share them)"
    )
    header = (
        f"{'case':<22}{'plan us':>9}{'naive us':>10}{'columns us':>12}{'ratio':>7}{'objects us':>12}"
        f"{'ratio':>7}{'ranges/blk naive':>18}{'merged':>8}{'min B':>7}"
    )
    print(header)
    print("-" * len(header))
    for kind in (LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER):
        for p, d in ((8, 2), (2, 8), (4, 4)):
            producer, consumer = _side(p, kind), _side(d, kind)
            plan_us = _median_us(partial(plan_transfer, producer, consumer), repeats)
            plan = plan_transfer(producer, consumer)
            for order, (src, dst) in orders.items():
                naive_us = _median_us(partial(_naive, plan, src, dst), repeats)
                columns_us = _median_us(partial(_columns, plan, src, dst), repeats)
                objects_us = _median_us(partial(_objects, plan, src, dst), repeats)
                before = len(_naive(plan, src, dst)) / blocks
                after = _columns(plan, src, dst) / blocks
                smallest = min(c.length for pair in plan.pairs for c in pair.block_copies)
                name = f"{kind.value[:8]} {p}->{d} {order[:6]}"
                print(
                    f"{name:<22}{plan_us:>9.0f}{naive_us:>10.0f}"
                    f"{columns_us:>12.0f}{columns_us / naive_us:>7.2f}"
                    f"{objects_us:>12.0f}{objects_us / naive_us:>7.2f}"
                    f"{before:>18.2f}{after:>8.3f}{smallest:>7}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
