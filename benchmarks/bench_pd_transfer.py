"""P/D transfer cost: planning a large request, and pushing it through ``MooncakePeerTransport``.

Planning: for 80 layers, 8 KV heads, TP 8 -> 4, HND FlashInfer blocks, the time to build the plan and
to turn one producer rank's share of a 1000-block request into write columns for every layer (what
``PDProducer`` does per pull), against a naive per-block, per-layer expansion of the same ranges in the
same run.

Throughput: the byte ranges of a TP 2 -> 1 transfer (producer rank 0's heads into the consumer's
blocks, every layer), written through the transport (``submit_write_columns`` + ``wait``) and through a
second raw ``TransferEngine`` (``batch_transfer_sync_write`` of the same ranges, 512 a batch) into the same
consumer engine, timed back to back after a short idle gap; medians, and the median of the per-repeat
ratios (raw time / transport time: 1.0 means no overhead). Loopback TCP.

Mooncake listens on every interface, so the benchmark re-executes itself inside a loopback-only network
namespace (``unshare -n``, needs root) unless it already runs in one.

    python -m benchmarks.bench_pd_transfer [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import numpy.typing as npt

from benchmarks.engine_env import loopback_only
from kvcore.config import PDConfig
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.transfer_plan import TPSide, TransferPlan, plan_transfer
from kvcore.ports import MemoryRegion

IntArray = npt.NDArray[np.int64]
IDLE_S = 0.05  # pause before each timed call, so that the engines' polling threads settle
RAW_BATCH = 512  # the raw engine's entries per batch: as the transport's (one batch of 4096 fails on TCP)


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _side(tp: int, layers: int, blocks: int, heads: int, head_size: int, tokens: int) -> TPSide:
    layout = KVLayout(LayoutKind.FLASH_INFER, blocks, tokens, heads // tp, head_size, 2, HeadOrder.HND)
    return TPSide(tp, layout, heads, layers)


def _columns(plan: TransferPlan, bases: IntArray, src: Sequence[int], dst: Sequence[int]) -> int:
    """Producer rank 0's write columns for every layer, as ``PDProducer`` builds them."""
    total = 0
    for pair in plan.pairs_for_producer(0):
        cols = plan.materialize_columns(pair, src, dst)
        total += len((bases[:, None] + np.asarray(cols.src_offsets, dtype=np.int64)).ravel())
    return total


def _naive(plan: TransferPlan, bases: Sequence[int], src: Sequence[int], dst: Sequence[int]) -> int:
    src_stride, dst_stride = plan.producer.layout.block_stride, plan.consumer.layout.block_stride
    ranges = [
        (base + c.src_offset + s * src_stride, base + c.dst_offset + d * dst_stride, c.length)
        for pair in plan.pairs_for_producer(0)
        for base in bases
        for s, d in zip(src, dst, strict=True)
        for c in pair.block_copies
    ]
    return len(ranges)


def bench_plan(blocks: int, repeats: int) -> None:
    layers, heads = 80, 8
    producer, consumer = _side(8, layers, 4096, heads, 128, 16), _side(4, layers, 4096, heads, 128, 16)
    src, dst = list(range(100, 100 + blocks)), list(range(2000, 2000 + blocks))
    bases_list = [i << 32 for i in range(layers)]
    bases = np.asarray(bases_list, dtype=np.int64)
    plan_s = _median_s(partial(plan_transfer, producer, consumer), repeats)
    plan = plan_transfer(producer, consumer)
    columns_s = _median_s(partial(_columns, plan, bases, src, dst), repeats)
    naive_s = _median_s(partial(_naive, plan, bases_list, src, dst), max(1, repeats // 3))
    ranges = _columns(plan, bases, src, dst)
    print(f"plan: {layers} layers, {heads} KV heads, TP 8 -> 4, FlashInfer HND, {blocks} consecutive blocks")
    print(f"{'step':<34}{'ms':>10}{'naive ms':>10}{'speed-up':>10}{'ranges':>10}")
    print(f"{'plan_transfer':<34}{plan_s * 1e3:>10.3f}{'':>10}{'':>10}{'':>10}")
    print(
        f"{'rank 0 write columns, all layers':<34}{columns_s * 1e3:>10.3f}{naive_s * 1e3:>10.2f}"
        f"{naive_s / columns_s:>10.1f}{ranges:>10}"
    )


def bench_transfer(layers: int, blocks: int, repeats: int) -> None:
    from mooncake.engine import TransferEngine

    from kvcore_mooncake.pd import MooncakePeerTransport

    heads, head_size, tokens = 8, 128, 16
    producer, consumer = (
        _side(2, layers, blocks, heads, head_size, tokens),
        _side(1, layers, blocks, heads, head_size, tokens),
    )
    plan = plan_transfer(producer, consumer)
    src_mem = np.random.default_rng(0).integers(0, 256, layers * producer.layout.nbytes, dtype=np.uint8)
    dst_mem = np.zeros(layers * consumer.layout.nbytes, dtype=np.uint8)
    src_bases = src_mem.ctypes.data + producer.layout.nbytes * np.arange(layers, dtype=np.int64)
    dst_bases = dst_mem.ctypes.data + consumer.layout.nbytes * np.arange(layers, dtype=np.int64)
    rng = np.random.default_rng(1)
    request = blocks // 2
    src_blocks = sorted(rng.choice(blocks, request, replace=False).tolist())
    dst_blocks = rng.choice(blocks, request, replace=False).tolist()
    (pair,) = plan.pairs_for_producer(0)
    cols = plan.materialize_columns(pair, src_blocks, dst_blocks)
    srcs = (src_bases[:, None] + np.asarray(cols.src_offsets, dtype=np.int64)).ravel()
    dsts = (dst_bases[:, None] + np.asarray(cols.dst_offsets, dtype=np.int64)).ravel()
    lengths = np.tile(np.asarray(cols.lengths, dtype=np.int64), layers)
    nbytes = int(lengths.sum())

    config = PDConfig()
    sender, receiver = MooncakePeerTransport.open(config), MooncakePeerTransport.open(config)
    raw = TransferEngine()
    if raw.initialize(config.host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("the raw TransferEngine did not start")
    sender.register([_region(src_mem)])
    receiver.register([_region(dst_mem)])
    if raw.register_memory(src_mem.ctypes.data, src_mem.nbytes) != 0:
        raise RuntimeError("the raw TransferEngine did not register the source")
    peer = receiver.address
    lists = (srcs.tolist(), dsts.tolist(), lengths.tolist())
    chunks = [slice(i, i + RAW_BATCH) for i in range(0, len(lengths), RAW_BATCH)]

    def through_transport() -> None:
        (result,) = sender.wait([sender.submit_write_columns(peer, srcs, dsts, lengths)], 600.0)
        if not result.ok:
            raise RuntimeError(f"transport write failed: {result.error}")

    def through_raw() -> None:
        for chunk in chunks:
            if raw.batch_transfer_sync_write(peer, lists[0][chunk], lists[1][chunk], lists[2][chunk]) != 0:
                raise RuntimeError("raw batch write failed")

    through_transport()
    through_raw()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((through_transport, times[0]), (through_raw, times[1])):
            time.sleep(IDLE_S)
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    ratio = statistics.median(r / t for t, r in zip(*times, strict=True))
    transport_s, raw_s = statistics.median(times[0]), statistics.median(times[1])
    expected = np.concatenate(
        [
            src_mem[s - src_mem.ctypes.data : s - src_mem.ctypes.data + n]
            for s, n in zip(srcs[:64], lengths[:64], strict=True)
        ]
    )
    got = np.concatenate(
        [
            dst_mem[d - dst_mem.ctypes.data : d - dst_mem.ctypes.data + n]
            for d, n in zip(dsts[:64], lengths[:64], strict=True)
        ]
    )
    if not np.array_equal(expected, got):
        raise RuntimeError("the destination does not hold the source bytes")
    print(
        f"\ntransfer: TP 2 -> 1, {layers} layers x {request} of {blocks} blocks (shuffled), "
        f"{len(lengths)} ranges of {int(lengths[0]) // 1024} KiB, {nbytes / 2**20:.0f} MiB, loopback TCP"
    )
    print(f"{'path':<34}{'GB/s':>10}{'raw GB/s':>10}{'ratio':>10}")
    rates = f"{nbytes / transport_s / 1e9:>10.2f}{nbytes / raw_s / 1e9:>10.2f}"
    print(f"{'MooncakePeerTransport':<34}{rates}{ratio:>10.2f}")
    sender.close()
    receiver.close()


def _region(buffer: npt.NDArray[np.uint8]) -> MemoryRegion:
    return MemoryRegion(buffer.ctypes.data, buffer.nbytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a smaller request and fewer repeats (seconds)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 7, quick 3)")
    args = parser.parse_args(argv)
    refused = loopback_only("benchmarks.bench_pd_transfer", sys.argv[1:] if argv is None else argv)
    if refused is not None:
        return refused
    repeats = args.repeats or (3 if args.quick else 7)
    bench_plan(200 if args.quick else 1000, repeats)
    if args.quick:
        bench_transfer(layers=4, blocks=128, repeats=repeats)
    else:
        bench_transfer(layers=16, blocks=512, repeats=repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
