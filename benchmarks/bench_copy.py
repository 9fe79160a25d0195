"""Block copy throughput through ``TorchBlockMover`` against a plain copy of the same bytes.

For each host block size and id pattern, saves (gather: engine -> host) and loads (scatter: host ->
engine) ``n`` blocks through the mover, and times a contiguous ``torch`` copy of the same total bytes with
the same number of threads between the same two buffers, in the same run: timed back to back after a
short idle gap, medians of the repeats; the ratio is the median of the per-repeat ratios. The engine is
laid out like vLLM CPU: every layer a view into one storage, layer after layer (vLLM's LB* orders), or with
``--cross-layer`` block after block, each block holding every layer's (vLLM's BL* orders: a block of every
layer is one run of memory). Id patterns, from pools twice the size of
the copy: ``contiguous`` is one run on both sides; ``chunks`` draws engine ids at random and host ids as
whole slots of 16 consecutive blocks (what the scheduler hands out); ``random`` draws both at random.

On a CUDA machine it also measures device -> host and host -> device copies, and both at once, against
``copy_`` between the device and page-locked memory of the same bytes.

    python -m benchmarks.bench_copy [--quick] [--threads 2] [--layers 1] [--cross-layer]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch

from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.ports import BlockTransfer, Direction
from kvcore_cpu import EngineKV, HostMemory, TorchBlockMover

KiB = 1 << 10
MiB = 1 << 20
SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB)
HEAD = 64  # head size; bf16, one KV head: a token of one layer holds 2 * 64 * 2 bytes


IDLE_S = 0.05
"""Pause before each timed call: torch's OpenMP threads spin for a while after a parallel copy and would
steal the cores of whatever runs next (measured: the mover ran at half speed right after the baseline)."""


def _measure(
    run: Callable[[], None], baseline: Callable[[], None], repeats: int
) -> tuple[float, float, float]:
    """Median seconds of ``run`` and of ``baseline``, and the median of their per-repeat ratios.

    The two are timed back to back in each repeat, after one warm-up each, so that a change in the load
    of a shared machine hits both sides of a ratio alike.
    """
    run()
    baseline()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((run, times[0]), (baseline, times[1])):
            time.sleep(IDLE_S)
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    ratios = [b / r for r, b in zip(*times, strict=True)]
    return statistics.median(times[0]), statistics.median(times[1]), statistics.median(ratios)


def _engine(
    blocks: int, block_bytes: int, layers: int, device: torch.device, *, cross_layer: bool = False
) -> tuple[EngineKV, torch.Tensor]:
    """An engine with every layer in one storage (vLLM CPU style), and that storage as flat bytes;
    ``cross_layer``: blocks outermost, a block holding every layer's."""
    tokens = block_bytes // layers // (4 * HEAD)
    shape = (blocks, layers) if cross_layer else (layers, blocks)
    storage = torch.randint(-100, 100, (*shape, 1, tokens, 2 * HEAD), dtype=torch.int16, device=device)
    layout = KVLayout(LayoutKind.VLLM_CPU, blocks, tokens, 1, HEAD, 2)
    per_layer = storage.view(torch.bfloat16)
    if cross_layer:
        layout = attrs.evolve(layout, page_bytes=layers * layout.block_bytes)
        per_layer = per_layer.transpose(0, 1)
    kv = EngineKV.register(list(per_layer.unbind(0)), layout)
    return kv, storage.view(torch.uint8).view(-1)


PATTERNS = ("contiguous", "chunks", "random")
CHUNK = 16  # host blocks per slot in the "chunks" pattern


def _ids(pattern: str, count: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """Engine and host ids of one copy of ``count`` blocks, from pools of ``2 * count`` blocks."""
    if pattern == "contiguous":
        return list(range(count // 2, count // 2 + count)), list(range(count))
    engine = rng.choice(2 * count, count, replace=False).tolist()
    if pattern == "random":
        return engine, rng.choice(2 * count, count, replace=False).tolist()
    slots = rng.choice(2 * count // CHUNK, -(-count // CHUNK), replace=False)
    return engine, (slots[:, None] * CHUNK + np.arange(CHUNK)).ravel()[:count].tolist()


def _mover_run(mover: TorchBlockMover, transfers: Sequence[BlockTransfer]) -> Callable[[], None]:
    def run() -> None:
        jobs = [mover.submit(t) for t in transfers]
        results = mover.wait(jobs, 600.0)
        if not all(r.ok for r in results):
            raise RuntimeError(f"copy failed: {results}")

    return run


def _row(label: str, nbytes: int, measured: tuple[float, float, float]) -> str:
    seconds, base, ratio = measured
    return f"{label:<34} {nbytes / seconds / 1e9:8.2f} {nbytes / base / 1e9:9.2f} {ratio:7.2f}"


def bench_cpu(
    sizes: Sequence[int], layers: int, threads: int, min_bytes: int, repeats: int, cross_layer: bool
) -> None:
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    order = "block after block" if cross_layer else "layer after layer"
    print(f"CPU: {layers} layer(s) in one storage, {order}, {threads} copy thread(s); baseline: torch copy_")
    print(f"{'block / ids / direction':<34} {'GB/s':>8} {'copy GB/s':>9} {'ratio':>7}")
    rng = np.random.default_rng(0)
    for size in sizes:
        count = max(256 if min_bytes >= 64 * MiB else 32, -(-min_bytes // size))
        kv, engine_bytes = _engine(2 * count, size, layers, cpu, cross_layer=cross_layer)
        nbytes = count * size
        with HostMemory.allocate(2 * count, kv.host_block_bytes, cpu) as host:
            host.buffer.fill_(1)
            # The baseline copies between the same two buffers: where memory lies changes its speed.
            plain = {
                Direction.SAVE: _plain_copy(host.buffer[:nbytes], engine_bytes[:nbytes]),
                Direction.LOAD: _plain_copy(engine_bytes[:nbytes], host.buffer[:nbytes]),
            }
            mover = TorchBlockMover(kv, host, copy_threads=threads)
            for pattern in PATTERNS:
                engine_ids, host_ids = _ids(pattern, count, rng)
                for direction in Direction:
                    transfer = BlockTransfer(direction, engine_ids, host_ids)
                    measured = _measure(_mover_run(mover, [transfer]), plain[direction], repeats)
                    label = f"{size // KiB} KiB x {count} / {pattern} / {direction.value}"
                    print(_row(label, nbytes, measured), flush=True)
            mover.close()


def bench_cuda(sizes: Sequence[int], layers: int, min_bytes: int, repeats: int, cross_layer: bool) -> None:
    gpu = torch.device("cuda")
    order = "block after block" if cross_layer else "layer after layer"
    print(
        f"CUDA: {layers} layer(s) in one storage, {order}; baseline: copy_ between device and page-locked "
        "memory"
    )
    print(f"{'block / ids / direction':<34} {'GB/s':>8} {'copy GB/s':>9} {'ratio':>7}")
    rng = np.random.default_rng(0)
    for size in sizes:
        count = max(256, -(-min_bytes // size))
        kv, device_bytes = _engine(2 * count, size, layers, gpu, cross_layer=cross_layer)
        nbytes = count * size
        with HostMemory.allocate(2 * count, kv.host_block_bytes, gpu) as host:
            mover = TorchBlockMover(kv, host)
            pinned = host.buffer[: 2 * nbytes]
            for pattern in PATTERNS:
                engine_ids, host_ids = _ids(pattern, count, rng)
                half = count // 2
                cases = {
                    "save": (
                        [BlockTransfer(Direction.SAVE, engine_ids, host_ids)],
                        _d2h(device_bytes, pinned, nbytes),
                    ),
                    "load": (
                        [BlockTransfer(Direction.LOAD, engine_ids, host_ids)],
                        _h2d(device_bytes, pinned, nbytes),
                    ),
                    "both": (
                        [
                            BlockTransfer(Direction.SAVE, engine_ids[:half], host_ids[:half]),
                            BlockTransfer(Direction.LOAD, engine_ids[half:], host_ids[half:]),
                        ],
                        _both(device_bytes, pinned, nbytes),
                    ),
                }
                for name, (transfers, baseline) in cases.items():
                    measured = _measure(_mover_run(mover, transfers), baseline, repeats)
                    label = f"{size // KiB} KiB x {count} / {pattern} / {name}"
                    print(_row(label, nbytes, measured), flush=True)
            mover.close()


def _d2h(device_bytes: torch.Tensor, pinned: torch.Tensor, nbytes: int) -> Callable[[], None]:
    def run() -> None:
        pinned[:nbytes].copy_(device_bytes[:nbytes], non_blocking=True)
        torch.cuda.synchronize()

    return run


def _h2d(device_bytes: torch.Tensor, pinned: torch.Tensor, nbytes: int) -> Callable[[], None]:
    def run() -> None:
        device_bytes[:nbytes].copy_(pinned[:nbytes], non_blocking=True)
        torch.cuda.synchronize()

    return run


def _both(device_bytes: torch.Tensor, pinned: torch.Tensor, nbytes: int) -> Callable[[], None]:
    """Half the bytes each way at once, on two streams (what the mover's two copy streams do)."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]  # type: ignore[no-untyped-call]  # untyped __new__
    half = nbytes // 2

    def run() -> None:
        with torch.cuda.stream(streams[0]):
            pinned[:half].copy_(device_bytes[:half], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            device_bytes[nbytes : nbytes + half].copy_(pinned[nbytes : nbytes + half], non_blocking=True)
        torch.cuda.synchronize()

    return run


def _plain_copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        dst.copy_(src)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small copies and few repeats (seconds)")
    parser.add_argument(
        "--threads", type=int, default=2, help="copy threads, and torch threads of the baseline"
    )
    parser.add_argument("--layers", type=int, default=1, help="layers sharing one host block")
    parser.add_argument(
        "--cross-layer", action="store_true", help="blocks outermost: a block holds every layer's (BL*)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed repeats per case (default 7, quick 3)"
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    min_bytes = 8 * MiB if args.quick else 64 * MiB
    for size in SIZES:
        if size % (args.layers * 4 * HEAD):
            parser.error(f"--layers {args.layers}: a {size}-byte block does not split into whole tokens")
    bench_cpu(SIZES, args.layers, args.threads, min_bytes, repeats, args.cross_layer)
    if torch.cuda.is_available():
        bench_cuda(SIZES, args.layers, min_bytes, repeats, args.cross_layer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
