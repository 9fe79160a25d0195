"""``ChunkDirectory``: the folder a disk tier keeps its chunks in, shared safely by every process that
opens it (the ranks of one engine, and other engines on the host).

Layout under the configured path::

    kvcore-disk.json        {"format": 1}: written once; a folder of another format is refused
    usage.lock              the lock every process takes to commit, account or evict; it holds the
                            bytes of chunk files and the evictions so far (read without the lock)
    chunks/ab/cdef...       one file per chunk (``chunk_file``), named by a digest of its key

Nothing is held in memory that another process could change: a lookup asks the file system, a read
opens the file (a file evicted after that still reads whole: POSIX keeps an unlinked file's data while
it is open), a write renames a whole file into place under the lock and counts it there. The only
shared state, the counters, lives in the lock file and changes under ``flock``; eviction happens under
the same lock, after a fresh scan, so two processes never evict for the same overflow. LRU order is the
files' modification time, which every read bumps. The scan at open is the index rebuild: it sums the
chunk files, and removes the temporaries of writers that are gone (or older than ``ORPHAN_AGE_S``).

Reads never take the lock. Everything that takes it waits a bounded time (``LockBusy`` after it): a
process that holds it and stops (frozen, stopped by a debugger) costs the others the saves they drop,
never a hang.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from attrs import frozen

from kvcore.errors import ConfigError
from kvcore.kit.settings import format_size
from kvcore_disk.chunk_file import FORMAT, chunk_name, fsync_folder

__all__ = [
    "LOCK",
    "LOCK_WAIT_S",
    "ChunkDirectory",
    "DirectoryScan",
    "unusable",
    "LockBusy",
    "folder_problem",
    "marker_problem",
    "read_marker",
    "size_problem",
]

log = logging.getLogger(__name__)

MARKER = "kvcore-disk.json"
LOCK = "usage.lock"
CHUNKS = "chunks"
LOW_WATER = 0.9
"""An eviction frees down to this share of the size, so that it runs once per tenth of the tier filled,
not once per chunk."""
ORPHAN_AGE_S = 3600.0
"""A temporary this old is a dead writer's, whatever its process id says: a chunk file takes seconds."""
LOCK_WAIT_S = 2.0
"""How long a save, a removal or an eviction waits for the lock (others hold it for a rename and a
counter, or for the scan of an eviction) before it gives up."""
OPEN_WAIT_S = 30.0
"""How long opening the directory (its scan) and ``clear`` wait for the lock."""
_COUNTS = struct.Struct("<QQ")  # in the lock file: bytes of chunk files, files evicted since it was made


class LockBusy(TimeoutError):
    """The directory's lock stayed held by another process (or thread) for as long as the caller waits."""

    def __init__(self, lock: Path, holder: str = "another process") -> None:
        super().__init__(f"{lock} stayed locked by {holder}")


@frozen
class DirectoryScan:
    """What a scan found: chunk files and their bytes, and the dead writers' temporaries it removed."""

    files: int
    bytes: int
    removed_temporaries: int
    seconds: float


class ChunkDirectory:
    """A checked, shared chunk folder of at most ``size`` bytes of chunk files.

    ``open`` refuses, with a ``ConfigError`` naming ``field`` and the path, a path that does not exist,
    is not a directory or not writable, holds another format, or that the process cannot use for any
    other reason the system gives (a name too long, a folder it may not enter, a lock file it may not
    open: the cause is named), and a ``size`` above what its file system holds in all. A ``size`` above
    what it can give now (free space plus the chunks already there: another program filled the disk) is
    taken, with a warning: the tier holds what fits, and saves that find the disk full are dropped.
    """

    def __init__(self, root: Path, size: int, field: str = "backend.path") -> None:
        self.root = root
        self.size = size
        self._field = field
        self._chunks = root / CHUNKS
        self._prefix = f"{self._chunks}/"
        self.lock_path = root / LOCK
        self._thread_lock = threading.Lock()  # flock is per open file: threads of one process queue here
        self.evicted_files = 0  # by this process
        self._cleaned = 0  # temporaries removed by the last scan

    @classmethod
    def open(
        cls, root: Path, size: int, *, field: str = "backend.path", size_field: str = "backend.size"
    ) -> ChunkDirectory:
        """Check ``root``, write its marker if it has none, rebuild its usage (``scan``), and evict down to
        ``size`` what a larger size left there."""
        directory = cls(root, size, field)
        try:
            return directory._open(size_field)
        except LockBusy as exc:
            raise ConfigError(
                field, str(root), f"a directory whose {LOCK} other processes let go ({exc})"
            ) from None
        except OSError as exc:
            raise ConfigError(field, str(root), unusable(exc)) from None

    def _open(self, size_field: str) -> ChunkDirectory:
        root, size = self.root, self.size
        self._check_folder()
        self._check_marker()
        for fan in range(256):
            (self._chunks / f"{fan:02x}").mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(root)
        if size > usage.total:
            raise ConfigError(size_field, size, size_problem(root, usage.total))
        with self._locked(OPEN_WAIT_S) as fd:
            found = self._scan()
            _write_used(fd, self._evict(fd) if found.bytes > size else found.bytes)
        if size > usage.free + found.bytes:
            log.warning(
                "kvcore disk tier %s: size %d is more than its file system can give now (%d free beside %d "
                "bytes of chunks here): it holds what fits, and saves that find the disk full are dropped",
                root,
                size,
                usage.free,
                found.bytes,
            )
        log.info(
            "kvcore disk tier %s: %d chunk files, %d bytes (scanned in %.3f s, %d stale temporaries removed"
            "%s)",
            root,
            found.files,
            found.bytes,
            found.seconds,
            found.removed_temporaries,
            f", {self.evicted_files} evicted down to the size {size}" if self.evicted_files else "",
        )
        return self

    def path(self, key: str) -> Path:
        """Where ``key``'s chunk file is (or would be)."""
        return Path(self.file(key))

    def file(self, key: str) -> str:
        """``path`` as a string: lookups and reads name many files, and a ``Path`` costs more than a stat."""
        folder, name = chunk_name(key)
        return f"{self._prefix}{folder}/{name}"

    def counts(self) -> tuple[int, int]:
        """The bytes of chunk files (exact after every scan) and the files evicted since the directory's
        lock file was made, by every process; read from the lock file without taking the lock (one
        ``pread`` of what one ``pwrite`` wrote), so that a scan in another process never holds it up."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0, 0
        try:
            return _read(fd)
        finally:
            os.close(fd)

    def usage(self) -> int:
        """The bytes of chunk files (``counts``)."""
        return self.counts()[0]

    def commit(
        self, temporary: str, path: str, nbytes: int, *, fsync: bool = False, wait: float = LOCK_WAIT_S
    ) -> bool:
        """Rename a chunk file written under ``temporary`` (``write_temporary``) to ``path`` and account its
        ``nbytes``, evicting the least recently used files if the tier is then over its size; under the
        lock (waited for at most ``wait`` seconds), so that a scan never counts a file twice. A key whose
        file is already there keeps it (the temporary is removed): returns whether this file became the
        chunk's. Raises ``OSError`` (``LockBusy`` after the wait; the temporary removed)."""
        try:
            with self._locked(wait) as fd:
                if os.path.exists(path):
                    _unlink(temporary)
                    return False
                os.rename(temporary, path)
                usage = _read(fd)[0] + nbytes
                _write_used(fd, usage)  # counted before eviction: what is on disk is never uncounted
                if usage > self.size:
                    _write_used(fd, self._evict(fd))
        except BaseException:
            _unlink(temporary)
            raise
        if fsync:
            fsync_folder(os.path.dirname(path))
        return True

    def remove(self, paths: list[str] | list[Path], *, wait: float = LOCK_WAIT_S) -> int:
        """Remove chunk files (missing ones are skipped); the bytes freed. Raises ``LockBusy`` when the
        lock stays held for ``wait`` seconds (nothing removed)."""
        with self._locked(wait) as fd:
            freed = sum(_unlink(path) for path in paths)
            _write_used(fd, _read(fd)[0] - freed)
        return freed

    def clear(self) -> None:
        """Remove every chunk file (every process's). Raises ``LockBusy`` when the lock stays held for
        ``OPEN_WAIT_S`` (nothing removed)."""
        with self._locked(OPEN_WAIT_S) as fd:
            for folder in self._folders():
                for entry in os.scandir(folder):
                    if entry.is_file(follow_symlinks=False) and not entry.name.startswith("."):
                        _unlink(entry.path)
            _write_used(fd, 0)

    def scan(self) -> DirectoryScan:
        """Rebuild the usage counter from the files (and remove dead writers' temporaries). Raises
        ``LockBusy`` when the lock stays held for ``OPEN_WAIT_S``."""
        with self._locked(OPEN_WAIT_S) as fd:
            found = self._scan()
            _write_used(fd, found.bytes)
            return found

    # -- under the lock ------------------------------------------------------------------------------

    def _scan(self) -> DirectoryScan:
        start = time.perf_counter()
        files = total = 0
        for _, size, _ in self._chunk_files(clean=True):
            files += 1
            total += size
        return DirectoryScan(files, total, self._cleaned, time.perf_counter() - start)

    def _chunk_files(self, *, clean: bool = False) -> Iterator[tuple[int, int, str]]:
        """``(modification time, size, path)`` of every chunk file; with ``clean``, temporaries of writers
        that are gone are removed on the way (counted in ``_cleaned``). Entries that are not regular
        files, vanish meanwhile or cannot be read are skipped (logged): a stray entry in the folder
        never stops a scan or an eviction."""
        self._cleaned = 0
        for folder in self._folders():
            try:
                entries = list(os.scandir(folder))
            except OSError as exc:
                log.warning("kvcore disk tier: cannot list %s: %s", folder, exc)
                continue
            for entry in entries:
                try:
                    stat = entry.stat(follow_symlinks=False)
                    if entry.name.startswith("."):
                        self._cleaned += clean and _remove_if_orphaned(entry.path, stat.st_mtime)
                    elif os.path.isfile(entry.path) and not entry.is_symlink():
                        yield stat.st_mtime_ns, stat.st_size, entry.path
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    log.warning("kvcore disk tier: skipped %s: %s", entry.path, exc)

    def _evict(self, fd: int) -> int:
        """Remove the least recently used files until the tier holds at most ``LOW_WATER`` of its size;
        the bytes left. Scans first: other processes' writes count too. Counts the files it removed in
        the lock file ``fd``. A file it cannot remove is skipped (logged)."""
        found = sorted(self._chunk_files())
        usage = sum(size for _, size, _ in found)
        target = int(self.size * LOW_WATER)
        evicted = 0
        for _, size, path in found:
            if usage <= target:
                break
            try:
                gone = _unlink(path)
            except OSError as exc:
                log.warning("kvcore disk tier: cannot evict %s: %s", path, exc)
                continue
            usage -= size if gone else 0
            evicted += 1 if gone else 0
        self.evicted_files += evicted
        used, evictions = _read(fd)
        os.pwrite(fd, _COUNTS.pack(used, evictions + evicted), 0)
        return usage

    def _folders(self) -> Iterator[Path]:
        for fan in range(256):
            folder = self._chunks / f"{fan:02x}"
            if folder.is_dir():
                yield folder

    @contextlib.contextmanager
    def _locked(self, wait: float) -> Iterator[int]:
        """The lock file's descriptor, the lock held; ``LockBusy`` when it is not free within ``wait``."""
        deadline = time.monotonic() + wait
        if not self._thread_lock.acquire(timeout=wait):
            raise LockBusy(self.lock_path, "another thread of this process")
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                _flock(fd, deadline, self.lock_path)
                yield fd
            finally:
                os.close(fd)  # releases the flock
        finally:
            self._thread_lock.release()

    # -- checks at open ------------------------------------------------------------------------------

    def _check_folder(self) -> None:
        problem = folder_problem(self.root)
        if problem is not None:
            raise ConfigError(self._field, str(self.root), problem)

    def _check_marker(self) -> None:
        try:
            text = read_marker(self.root)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(self._field, str(self.root), f"a readable {MARKER} ({exc})") from None
        if text is None:
            marker = self.root / MARKER
            temporary = marker.with_name(f".{MARKER}.{os.getpid()}.tmp")
            try:
                temporary.write_text(json.dumps({"format": FORMAT}) + "\n")
                os.replace(temporary, marker)
            except OSError as exc:
                temporary.unlink(missing_ok=True)
                raise ConfigError(
                    self._field, str(self.root), f"a directory this process can write to ({exc})"
                ) from None
            return
        problem = marker_problem(text)
        if problem is not None:
            raise ConfigError(self._field, str(self.root), problem)


def folder_problem(root: Path) -> str | None:
    """What a tier's folder must be and ``root`` is not (as ``open`` refuses it), or ``None``. Raises
    ``OSError`` for a path the system cannot look at (a name too long)."""
    if not root.exists():
        return "an existing directory (it does not exist)"
    if not root.is_dir():
        return "a directory (it is not one)"
    if not os.access(root, os.W_OK | os.X_OK):
        return "a directory this process can write to"
    return None


def marker_problem(text: str) -> str | None:
    """What a folder whose marker holds ``text`` should have held, or ``None`` for this format's."""
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        found = None
    if isinstance(found, dict) and found.get("format") == FORMAT:
        return None
    return (
        f"a kvcore disk tier directory of format {FORMAT}, but its {MARKER} says {text.strip()[:80]!r} "
        "(another kvcore version wrote it: use another path, or empty it)"
    )


def size_problem(root: Path, total: int) -> str:
    """What a size above what ``root``'s file system holds should have been."""
    return f"at most the {total} bytes ({format_size(total)}) the file system of {str(root)!r} holds in all"


def read_marker(root: Path) -> str | None:
    """The marker's text, ``None`` for a folder that has none yet. Raises ``OSError`` (and
    ``UnicodeDecodeError``) for one that cannot be read."""
    try:
        return (root / MARKER).read_text()
    except FileNotFoundError:
        return None


def _flock(fd: int, deadline: float, path: Path) -> None:
    """``flock`` ``fd`` exclusively by ``deadline``, or raise ``LockBusy``: polled, with a growing pause
    (flock has no timed wait)."""
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockBusy(path) from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.05)


def unusable(exc: OSError) -> str:
    """What a folder the system refused (``exc``) should have been, naming what the system said and of
    which file."""
    where = f": {exc.filename}" if exc.filename else ""
    return f"a directory this process can use ({exc.strerror or exc}{where})"


def _read(fd: int) -> tuple[int, int]:
    """The lock file's counts: bytes of chunk files, files evicted (zeros for a new or short file)."""
    data = os.pread(fd, _COUNTS.size, 0)
    if len(data) != _COUNTS.size:
        return 0, 0
    used, evictions = _COUNTS.unpack(data)
    return used, evictions


def _write_used(fd: int, used: int) -> None:
    os.pwrite(fd, _COUNTS.pack(max(used, 0), _read(fd)[1]), 0)


def _unlink(path: str | Path) -> int:
    """Remove ``path``; its bytes, 0 if it was already gone."""
    try:
        size = os.stat(path).st_size
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return size


def _remove_if_orphaned(path: str, modified: float) -> bool:
    """Remove a temporary (``.<name>.<pid>.<id>.tmp``) whose writer is no longer running, or that is older
    than ``ORPHAN_AGE_S`` (a writer in another PID namespace, or a reused PID); whether it was removed."""
    parts = os.path.basename(path).split(".")
    pid = int(parts[2]) if len(parts) == 5 and parts[2].isdigit() else None
    if pid is not None and _running(pid) and time.time() - modified < ORPHAN_AGE_S:
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        return True
    return False


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:  # EPERM: someone else's live process
        return exc.errno == errno.EPERM
    return True
