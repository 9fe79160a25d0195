"""The disk tier's pre-flight (``kvcore.plugins.preflight``): what ``ChunkDirectory.open`` would refuse or
warn of, found without creating or changing anything, and what the folder holds.

It shares each check with ``open`` (``folder_problem``, ``marker_problem``, ``size_problem``), so the two
cannot disagree. The chunks held come from the usage lock file (one read); ``deep`` also counts the
chunk files and groups them by the namespace in their keys, which reads every file's header.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from kvcore.kit.settings import format_size
from kvcore.plugins.preflight import Finding, PreflightContext, Verdict
from kvcore_disk.config import DiskConfig
from kvcore_disk.directory import (
    CHUNKS,
    LOCK,
    MARKER,
    ChunkDirectory,
    folder_problem,
    marker_problem,
    read_marker,
    size_problem,
    unusable,
)

__all__ = ["DEPENDENCY", "disk_findings"]

DEPENDENCY = "xxhash"
"""The module the chunk files' digests need (an extra of kvcore: ``kvcore[disk]``)."""
DEEP_FILES = 100_000
"""A deep scan reads at most this many files' headers (a few seconds)."""


def disk_findings(settings: DiskConfig, context: PreflightContext) -> Iterator[Finding]:
    """Every finding about a disk tier's settings under ``context.field``."""
    field = context.field
    if importlib.util.find_spec(DEPENDENCY) is None:
        yield Finding(
            "dependency",
            f"{field}.kind",
            Verdict.REFUSED,
            f"the disk tier's dependencies installed (no module named {DEPENDENCY!r}): pip install "
            "'kvcore[disk]'",
            "disk",
        )
    root = Path(settings.path)
    marker = None
    try:
        problem = folder_problem(root)
        if problem is None:
            marker = read_marker(root)
            problem = marker_problem(marker) if marker is not None else None
        if problem is None and (root / LOCK).exists():
            os.close(os.open(root / LOCK, os.O_RDWR | os.O_CLOEXEC))  # open checks it can, as here
    except UnicodeDecodeError as exc:
        problem = f"a readable {MARKER} ({exc})"
    except OSError as exc:
        problem = unusable(exc)
    if problem is not None:
        yield Finding("path", f"{field}.path", Verdict.REFUSED, problem, str(root))
        return
    yield Finding("path", f"{field}.path", Verdict.OK, f"{root} is a writable directory")
    usage = shutil.disk_usage(root)
    held = ChunkDirectory(root, settings.size).counts()[0]
    if settings.size > usage.total:
        yield Finding(
            "path", f"{field}.size", Verdict.REFUSED, size_problem(root, usage.total), settings.size
        )
    elif settings.size > usage.free + held:
        yield Finding(
            "path",
            f"{field}.size",
            Verdict.WARNING,
            f"{format_size(settings.size)} is more than the file system gives now "
            f"({format_size(usage.free)} free beside {format_size(held)} of chunks): the tier holds what "
            "fits, and saves that find the disk full are dropped",
        )
    else:
        yield Finding(
            "path",
            f"{field}.size",
            Verdict.OK,
            f"{format_size(settings.size)}; {format_size(usage.free)} free on its disk",
        )
    chunks = f"{format_size(held)} of chunk files" if marker is not None else "a new tier: no chunks yet"
    if context.deep and marker is not None:
        chunks = _namespaces(root)
    yield Finding("chunks", f"{field}.path", Verdict.OK, chunks)


def _namespaces(root: Path) -> str:
    """The chunk files under ``root``, by the namespace their keys name (the most held first)."""
    found: Counter[str] = Counter()
    unreadable = 0
    for n, path in enumerate(_files(root / CHUNKS)):
        if n == DEEP_FILES:
            break
        namespace = _namespace(path)
        if namespace is None:
            unreadable += 1
        else:
            found[namespace] += 1
    total = sum(found.values())
    kinds = ", ".join(f"{name} ({count})" for name, count in found.most_common(3))
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    bad = f"; {unreadable} not chunk files" if unreadable else ""
    capped = f" (the first {DEEP_FILES} read)" if total + unreadable >= DEEP_FILES else ""
    return (
        f"{total} chunk files{capped} in {len(found)} namespaces: {kinds}{more}{bad}"
        if total
        else (f"no chunk files{bad}")
    )


def _files(folder: Path) -> Iterator[str]:
    for fan in sorted(os.listdir(folder)) if folder.is_dir() else ():
        for entry in os.scandir(folder / fan):
            if entry.is_file(follow_symlinks=False) and not entry.name.startswith("."):
                yield entry.path


def _namespace(path: str) -> str | None:
    """The namespace digest in a chunk file's key (``kv/<namespace>/...``), or ``None`` for a file that
    is not a chunk file."""
    from kvcore_disk.chunk_file import read_key

    key = read_key(path)
    parts = key.split("/") if key is not None else []
    return parts[1][:16] if len(parts) > 2 and parts[0] == "kv" else None
