"""Disk tier: save and load throughput against a plain sequential copy of the same bytes, and the index
rebuild at start-up.

Throughput: ``--chunks`` chunks of ``--chunk-mib`` MiB go from a host buffer into the disk tier
(``DiskChunkStore.submit_put``, jobs of ``--batch`` chunks, as the worker submits them) and back
(``submit_get``); the baseline writes the same bytes from the same buffer into one file per chunk with one
``os.write`` each and reads them back with one ``os.readv`` each, the way ``dd`` copies (no header, no
digest, no rename). Both run on the same file system (``--dir``), in the same run; ratios are kvcore /
baseline. Reads run twice: *warm*, from the page cache right after the writes, and *cold*, after every
file was flushed and dropped from the page cache (``fsync`` + ``posix_fadvise(DONTNEED)``), which reads
the device. Writes go to the page cache in both (neither side flushes; ``--fsync`` makes both flush);
every timed run starts after ``sync``, so neither side pays for writing back the other's pages.
The last row, ``O_DIRECT``, compares kvcore's cold reads with the plain copy's reads through ``O_DIRECT``
(page-aligned memory, past the page cache): whether bypassing the cache would pay on this device.

Rebuild: ``--rebuild`` sizes (chunk files of one small value each) are created, then
``ChunkDirectory.open`` (the start-up scan) is timed, and a lookup of 64 keys through ``DiskChunkIndex``.

    python -m benchmarks.bench_disk [--quick] [--dir PATH] [--chunks N] [--chunk-mib M] [--threads T]
                                    [--fsync] [--rebuild 10000,100000]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvcore.ids import ChunkKey
from kvcore.ports import StoreItem
from kvcore_disk.chunk_file import file_bytes, write_temporary
from kvcore_disk.directory import ChunkDirectory
from kvcore_disk.index import DiskChunkIndex
from kvcore_disk.store import DiskChunkStore

MiB = 2**20


def drop_from_page_cache(root: Path) -> None:
    """Flush every file under ``root`` and drop it from the page cache: the next read hits the device."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(run: Callable[[], object]) -> float:
    """Seconds ``run`` takes, from a clean start: what an earlier run left dirty in the page cache is
    written back first, so that neither side pays for the other's writes."""
    os.sync()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class Baseline:
    """One file per chunk, one ``write``/``readv`` each: what a sequential copy costs on this disk."""

    def __init__(self, root: Path, host: memoryview, chunk: int, fsync: bool) -> None:
        self.root, self.host, self.chunk, self.fsync = root, host, chunk, fsync

    def save(self, count: int) -> None:
        for i in range(count):
            fd = os.open(self.root / f"{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, self.host[i * self.chunk : (i + 1) * self.chunk])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def load(self, count: int) -> None:
        for i in range(count):
            fd = os.open(self.root / f"{i}", os.O_RDONLY)
            try:
                os.readv(fd, [self.host[i * self.chunk : (i + 1) * self.chunk]])
            finally:
                os.close(fd)

    def load_direct(self, count: int) -> None:
        """The same reads with ``O_DIRECT`` (past the page cache) into page-aligned memory."""
        with mmap.mmap(-1, self.chunk) as aligned:
            view = memoryview(aligned)
            for i in range(count):
                fd = os.open(self.root / f"{i}", os.O_RDONLY | os.O_DIRECT)
                try:
                    os.readv(fd, [view])
                finally:
                    os.close(fd)
            view.release()


class Tier:
    """The disk tier's store, driven as the worker drives it."""

    def __init__(
        self, root: Path, host: memoryview, chunk: int, batch: int, fsync: bool, threads: int
    ) -> None:
        self.directory = ChunkDirectory.open(root, shutil.disk_usage(root).free // 2)
        self.store = DiskChunkStore(self.directory, host, fsync=fsync, io_threads=threads)
        self.chunk, self.batch = chunk, batch

    def _run(self, count: int, submit: Callable[[list[StoreItem]], object]) -> None:
        items = [StoreItem(ChunkKey(f"kv/bench/{i}"), i * self.chunk, self.chunk) for i in range(count)]
        jobs = [submit(items[i : i + self.batch]) for i in range(0, count, self.batch)]
        results = self.store.wait(jobs, 600)  # type: ignore[arg-type]
        assert len(results) == len(jobs), results
        assert all(r.ok for r in results), results

    def save(self, count: int) -> None:
        self._run(count, self.store.submit_put)

    def load(self, count: int) -> None:
        self._run(count, self.store.submit_get)


def throughput(
    root: Path, chunks: int, chunk: int, batch: int, repeats: int, fsync: bool, threads: int
) -> None:
    mapping = mmap.mmap(-1, chunks * chunk)  # page-aligned, as a pinned host pool is
    host = memoryview(mapping)
    for i in range(chunks):
        host[i * chunk : (i + 1) * chunk] = os.urandom(chunk)
    gib = chunks * chunk / 2**30
    print(
        f"throughput: {chunks} chunks x {chunk // MiB} MiB = {gib:.2f} GiB on {root} "
        f"(fsync: {fsync}, I/O threads: {threads}, {os.cpu_count()} CPUs)"
    )
    print(f"{'':10} {'kvcore GB/s':>12} {'baseline GB/s':>14} {'ratio':>6}")
    rows: dict[str, list[tuple[float, float]]] = {
        "save": [],
        "load warm": [],
        "load cold": [],
        "O_DIRECT": [],
    }
    for _ in range(repeats):
        for name in ("kvcore", "baseline"):
            shutil.rmtree(root / name, ignore_errors=True)
            (root / name).mkdir()
        tier = Tier(root / "kvcore", host, chunk, batch, fsync, threads)
        base = Baseline(root / "baseline", host, chunk, fsync)
        try:
            times = {"save": (_timed(partial(tier.save, chunks)), _timed(partial(base.save, chunks)))}
            times["load warm"] = (_timed(partial(tier.load, chunks)), _timed(partial(base.load, chunks)))
            drop_from_page_cache(root)
            times["load cold"] = (_timed(partial(tier.load, chunks)), _timed(partial(base.load, chunks)))
            times["O_DIRECT"] = (times["load cold"][0], _timed(partial(base.load_direct, chunks)))
        finally:
            tier.store.close()
        for name, (ours, theirs) in times.items():
            rows[name].append((ours, theirs))
    for name, runs in rows.items():
        ours = statistics.median(t for t, _ in runs)
        theirs = statistics.median(t for _, t in runs)
        gb = chunks * chunk / 1e9
        print(f"{name:10} {gb / ours:12.2f} {gb / theirs:14.2f} {theirs / ours:6.2f}")


def rebuild(root: Path, count: int) -> None:
    folder = root / f"rebuild-{count}"
    folder.mkdir()
    directory = ChunkDirectory.open(folder, shutil.disk_usage(folder).free // 2)
    value = memoryview(bytes(64))
    for i in range(count):
        key = f"kv/rebuild/{i}"
        path = directory.file(key)
        directory.commit(write_temporary(path, key, [value], fsync=False), path, file_bytes(key, len(value)))
    opened = _timed(lambda: ChunkDirectory.open(folder, directory.size))
    index = DiskChunkIndex(directory)
    keys = [[ChunkKey(f"kv/rebuild/{i}")] for i in range(64)]
    start = time.perf_counter()
    for _ in range(100):
        assert index.lookup(keys) == 64
    lookup_us = (time.perf_counter() - start) / 100 * 1e6
    print(
        f"rebuild: {count:>7} chunk files scanned at open in {opened:.3f} s; "
        f"lookup of 64 keys {lookup_us:.0f} us"
    )
    shutil.rmtree(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="a folder on the file system to measure")
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="chunks per job")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fsync", action="store_true")
    parser.add_argument("--threads", type=int, default=4, help="the store's I/O threads")
    parser.add_argument("--rebuild", default="10000,100000", help="chunk counts for the rebuild timing")
    parser.add_argument("--quick", action="store_true", help="32 chunks of 1 MiB, one repeat, 2,000 files")
    args = parser.parse_args(argv)
    if args.quick:
        args.chunks, args.chunk_mib, args.repeats, args.rebuild = 32, 1, 1, "2000"
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvcore-bench-disk-") as scratch:
        root = Path(scratch)
        throughput(
            root,
            args.chunks,
            args.chunk_mib * MiB,
            args.batch,
            args.repeats,
            args.fsync,
            args.threads,
        )
        for count in (int(c) for c in args.rebuild.split(",") if c):
            rebuild(root, count)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
