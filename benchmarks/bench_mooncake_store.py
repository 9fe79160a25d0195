"""Mooncake store throughput and lookup latency through kvcore against the raw Mooncake client.

Batch puts and gets of ``--values`` values per size go through ``MooncakeChunkStore`` (submit, then
wait) and, in the same run and alternating with it, through the raw ``batch_put_from`` /
``batch_get_into`` of the very same native client and registered buffer: the ratio is what kvcore's
job machinery costs (the median of per-repeat ratios; throughputs are medians). Two placements: the
segment in another process (a ``kvcore_mooncake.holder`` subprocess; the bench client holds nothing)
and the segment local to the bench client. Lookups of 256 keys (half present) through
``MooncakeChunkIndex`` (submit, then poll until answered) against the raw
``batch_is_exist`` of the same keys: p50 and p99.

Mooncake clients listen on every interface, so the bench runs in a loopback-only network namespace:
outside one it re-executes itself under ``unshare -n`` (root, or user namespaces, needed).

    python -m benchmarks.bench_mooncake_store [--quick] [--values 64]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from mooncake.store import MooncakeDistributedStore

from benchmarks.engine_env import loopback_only
from kvcore.ids import ChunkKey
from kvcore.kit.leading import leading_chunks
from kvcore.kit.settings import ByteCount, ByteSize
from kvcore.ports import StoreItem
from kvcore.testing.support import start_owned
from kvcore_mooncake import MooncakeChunkIndex, MooncakeChunkStore, MooncakeClient
from kvcore_mooncake.config import MooncakeStoreConfig

KiB = 1 << 10
MiB = 1 << 20
SIZES = (256 * KiB, 1 * MiB, 2 * MiB)
LOOKUP_KEYS = 256
POLL_S = 20e-6
MASTER = Path(sys.executable).parent / "mooncake_master"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def _process(argv: list[str], ready: Callable[[subprocess.Popen[str]], None]) -> Iterator[None]:
    """Run a helper process for the duration, stopped by its pid."""
    process = start_owned(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready(process)
        yield
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(5)
        if process.stdout is not None:
            process.stdout.close()


def _master(port: int) -> list[str]:
    return [
        str(MASTER),
        "--rpc_address=127.0.0.1",
        f"--rpc_port={port}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={_free_port()}",
    ]


def _port_open(port: int) -> Callable[[subprocess.Popen[str]], None]:
    def ready(_: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    return ready


def _printed_ready(process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("ready"):
        raise RuntimeError(f"the segment holder did not start: {line!r}")


@contextmanager
def mooncake_pool(holder_bytes: int | None) -> Iterator[str]:
    """A fresh ``mooncake_master`` on loopback and, given ``holder_bytes``, a segment holder of that
    size; yields the master's address. Both are stopped at the end."""
    port = _free_port()
    master = f"127.0.0.1:{port}"
    with ExitStack() as stack:
        stack.enter_context(_process(_master(port), _port_open(port)))
        if holder_bytes is not None:
            argv = [sys.executable, "-m", "kvcore_mooncake.holder", "--master", master]
            stack.enter_context(_process([*argv, "--segment-size", str(holder_bytes)], _printed_ready))
        yield master


class Bench:
    """One placement: a store and an index on one client, and that client's native object."""

    def __init__(self, stack: ExitStack, holder: bool, buffer_bytes: int) -> None:
        pool = 4 * buffer_bytes
        master = stack.enter_context(mooncake_pool(pool if holder else None))
        config = MooncakeStoreConfig(
            master=master,
            segment_size=ByteCount(0 if holder else pool),
            transfer_buffer_size=ByteSize(16 * MiB),
        )
        natives: list[MooncakeDistributedStore] = []

        def capture() -> MooncakeDistributedStore:
            natives.append(MooncakeDistributedStore())
            return natives[-1]

        client = MooncakeClient.connect(config, binding=capture)
        stack.callback(client.close)
        self.raw = natives[0]
        self.memory = ctypes.create_string_buffer(buffer_bytes)
        self.base = ctypes.addressof(self.memory)
        self.store = MooncakeChunkStore(client, self.base, buffer_bytes)
        stack.callback(self.store.close)
        self.index = MooncakeChunkIndex(client, timeout_s=1.0)
        stack.callback(self.index.close)

    def store_round(self, size: int, count: int) -> tuple[float, float]:
        items = [StoreItem(key, i * size, size) for i, key in enumerate(_keys(count))]
        start = time.perf_counter()
        (put,) = self.store.wait([self.store.submit_put(items)], 60)
        middle = time.perf_counter()
        (get,) = self.store.wait([self.store.submit_get(items)], 60)
        end = time.perf_counter()
        if not (put.ok and get.ok):
            raise RuntimeError(f"store round failed: {put.error or get.error}")
        return middle - start, end - middle

    def raw_round(self, size: int, count: int) -> tuple[float, float]:
        keys: list[str] = list(_keys(count))
        addresses = [self.base + i * size for i in range(count)]
        sizes = [size] * count
        start = time.perf_counter()
        put = self.raw.batch_put_from(keys, addresses, sizes)
        middle = time.perf_counter()
        get = self.raw.batch_get_into(keys, addresses, sizes)
        end = time.perf_counter()
        if any(put) or get != sizes:
            raise RuntimeError(f"raw round failed: {set(put)} {set(get)}")
        return middle - start, end - middle

    def lookups(self, repeats: int) -> tuple[list[float], list[float]]:
        keys = _keys(LOOKUP_KEYS)
        present = [StoreItem(key, 0, 64) for key in keys[: LOOKUP_KEYS // 2]]
        self.store.wait([self.store.submit_put(present)], 10)
        chunks = [[key] for key in keys]
        ours, raw = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            lookup_id = self.index.submit_lookup(chunks)
            # poll as a scheduler would, without spinning on the GIL the index's worker thread needs
            while (answer := self.index.poll_lookup(lookup_id)) is None:
                time.sleep(POLL_S)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            flags = self.raw.batch_is_exist(list(keys))
            raw_answer = leading_chunks(flags, lambda flag: flag == 1)
            raw.append(time.perf_counter() - start)
            if answer != raw_answer:
                raise RuntimeError(f"index answered {answer}, raw {raw_answer}")
        return ours, raw


def _keys(count: int) -> list[ChunkKey]:
    run = uuid.uuid4().hex
    return [ChunkKey(f"kv/bench/{run}/{i}") for i in range(count)]


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a run of a few seconds")
    parser.add_argument("--values", type=int, default=64, help="values per batch")
    args = parser.parse_args(argv)
    refused = loopback_only("benchmarks.bench_mooncake_store", sys.argv[1:] if argv is None else argv)
    if refused is not None:
        return refused
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    sizes = SIZES[::2] if args.quick else SIZES
    repeats = 3 if args.quick else 7
    count = args.values
    ours_l: list[float] = []
    raw_l: list[float] = []
    print(f"{'placement':<10} {'value':>8} {'op':<4} {'kvcore GB/s':>12} {'raw GB/s':>10} {'ratio':>6}")
    for placement, holder in (("holder", True), ("local", False)):
        with ExitStack() as stack:
            bench = Bench(stack, holder, count * max(sizes))
            for size in sizes:
                times: dict[str, list[float]] = {"sput": [], "sget": [], "rput": [], "rget": []}
                for _ in range(repeats):
                    put, get = bench.store_round(size, count)
                    times["sput"].append(put)
                    times["sget"].append(get)
                    put, get = bench.raw_round(size, count)
                    times["rput"].append(put)
                    times["rget"].append(get)
                    bench.store.clear()
                gigabytes = size * count / 1e9
                for op in ("put", "get"):
                    ours = statistics.median(times["s" + op])
                    raw = statistics.median(times["r" + op])
                    # the median of per-repeat ratios: a load change on a shared machine hits both sides
                    ratio = statistics.median(
                        r / o for o, r in zip(times["s" + op], times["r" + op], strict=True)
                    )
                    print(
                        f"{placement:<10} {size // KiB:>6}Ki {op:<4} {gigabytes / ours:>12.2f} "
                        f"{gigabytes / raw:>10.2f} {ratio:>6.2f}"
                    )
            if holder:
                ours_l, raw_l = bench.lookups(100 if args.quick else 1000)
    print(f"\nlookup of {LOOKUP_KEYS} keys  {'p50 us':>8} {'p99 us':>8}")
    for name, samples in (("kvcore index", ours_l), ("raw is_exist", raw_l)):
        print(f"{name:<22} {_pct(samples, 0.5) * 1e6:>8.0f} {_pct(samples, 0.99) * 1e6:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
