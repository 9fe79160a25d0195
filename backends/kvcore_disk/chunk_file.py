"""One chunk as one file: where it lives, its header, and moving its value with as few system calls as
possible.

A file is a header (a magic, the format version, the header's and the value's lengths, the value's
digest, the chunk's key; ``header_bytes(key)`` long) followed by the value. A reader knows the key and
the length it expects, so it reads header and value in one ``preadv``, straight into the host slot; the
file is good only if all of these match and the value's digest is the header's. A file is written under
a temporary name (``write_temporary``) and renamed into place by the directory (``ChunkDirectory.commit``),
so a name only ever shows a whole file; a file that a crash or a full disk left short, or that the disk
damaged, fails the check and reads as a miss.

The digest is XXH3-64 (``xxhash``, ~20 GB/s: a fifth of a copy's time, where zlib's CRC-32 took more
than the copy); it detects torn and damaged values, and is no defence against a writer that forges
files, which the directory's permissions are (see docs/disk.md). Files are read and
written through the page cache: ``O_DIRECT`` reads measured no faster from the device and far slower
for chunks still in the cache (docs/performance.md), so values are not page-aligned in the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import uuid
from collections.abc import Sequence
from pathlib import Path

import xxhash
from attrs import frozen

__all__ = [
    "FORMAT",
    "MAX_KEY_BYTES",
    "BadChunkFile",
    "ChunkHeader",
    "chunk_name",
    "digest",
    "file_bytes",
    "fsync_folder",
    "header_bytes",
    "read_key",
    "read_value",
    "temporary_name",
    "write_temporary",
]

FORMAT = 1
"""The file format this kvcore writes; a file of another format never reads as a chunk."""
MAGIC = b"KVCDISK\0"
_FIXED = struct.Struct("<8sIIQQI")  # magic, format, header bytes, value bytes, digest, key bytes
MAX_KEY_BYTES = 4096
_IOV_MAX = 1024  # buffers one pwritev/preadv takes (POSIX's IOV_MAX on Linux); a value of more parts loops


def digest(value: Sequence[bytes | memoryview]) -> int:
    """The digest a chunk file keeps of its value (its parts, one after another): XXH3-64."""
    if len(value) == 1:
        return xxhash.xxh3_64_intdigest(value[0])
    state = xxhash.xxh3_64()
    for part in value:
        state.update(part)
    return state.intdigest()


class BadChunkFile(Exception):
    """A file under a chunk's name that is not that chunk: damaged, truncated, or another format."""


def header_bytes(key: str) -> int:
    """The length of the header of ``key``'s file: the fixed part and the key, to a multiple of 8."""
    return -(-(_FIXED.size + len(key.encode())) // 8) * 8


def file_bytes(key: str, value_bytes: int) -> int:
    """The size of the file of ``key``'s value of ``value_bytes``."""
    return header_bytes(key) + value_bytes


@frozen
class ChunkHeader:
    """What the header of a chunk's file says."""

    key: str
    value_bytes: int
    digest: int

    def pack(self) -> bytes:
        key = self.key.encode()
        fixed = _FIXED.pack(MAGIC, FORMAT, header_bytes(self.key), self.value_bytes, self.digest, len(key))
        return (fixed + key).ljust(header_bytes(self.key), b"\0")

    @classmethod
    def unpack(cls, header: bytes | bytearray | memoryview) -> ChunkHeader:
        """Raises ``BadChunkFile`` unless ``header`` starts with a whole header of this format."""
        if len(header) < _FIXED.size:
            raise BadChunkFile(f"a header of {len(header)} bytes")
        magic, version, size, value_bytes, digest, key_bytes = _FIXED.unpack_from(header)
        if magic != MAGIC:
            raise BadChunkFile(f"magic {bytes(magic)!r}, not {MAGIC!r}")
        if version != FORMAT:
            raise BadChunkFile(f"format {version}, not format {FORMAT}")
        if key_bytes > MAX_KEY_BYTES or len(header) < _FIXED.size + key_bytes:
            raise BadChunkFile(f"a key of {key_bytes} bytes in a header of {len(header)}")
        try:
            key = bytes(header[_FIXED.size : _FIXED.size + key_bytes]).decode()
        except UnicodeDecodeError as exc:
            raise BadChunkFile(f"a key that is not UTF-8: {exc}") from None
        if size != header_bytes(key):
            raise BadChunkFile(f"a header of {size} bytes for a key of {key_bytes}")
        return cls(key, value_bytes, digest)


def chunk_name(key: str) -> tuple[str, str]:
    """The folder and file name of ``key``'s chunk: a SHA-256 of the key, so any key makes a safe name,
    fanned out over 256 folders so that no folder grows past a few thousand names per million chunks."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    return digest[:2], digest[2:]


def temporary_name(name: str) -> str:
    """A name beside ``name`` for the file being written: hidden (a leading dot), and carrying the writer's
    process id so that start-up can tell a dead writer's leftover from a live writer's file."""
    return f".{name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"


def write_temporary(path: str | Path, key: str, value: Sequence[memoryview], *, fsync: bool) -> str:
    """Write ``key``'s chunk (header and ``value``, its parts one after another, in one ``pwritev``) to a
    temporary file beside ``path``,
    flushed to the device first when ``fsync``; its name. Raises ``OSError`` (a full or read-only disk)
    or ``ValueError`` (a key longer than ``MAX_KEY_BYTES``); either way no file is left."""
    encoded = len(key.encode())
    if encoded > MAX_KEY_BYTES:
        raise ValueError(f"key of {encoded} bytes: at most {MAX_KEY_BYTES} fit in a chunk file's header")
    header = ChunkHeader(key, sum(len(part) for part in value), digest(value)).pack()
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, temporary_name(name))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(temporary, flags, 0o600)
    except FileNotFoundError:  # its folder was removed under the tier (an operator's cleanup): made again
        os.makedirs(folder, exist_ok=True)
        fd = os.open(temporary, flags, 0o600)
    try:
        try:
            _write_fully(fd, [header, *value])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return temporary


def read_value(path: str | Path, key: str, into: Sequence[memoryview]) -> bool:
    """Read ``key``'s value from ``path`` into ``into`` (its parts, exactly their length), and bump the file's
    modification time (the tier's LRU clock). Returns ``False`` when there is no such file, or when it
    holds a whole value of another length (both a miss, the file kept). Raises ``BadChunkFile`` when the
    file is not a whole chunk of ``key`` (the caller removes it); ``into`` is then undefined."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        size = os.fstat(fd).st_size
        header = bytearray(header_bytes(key))
        value_bytes = sum(len(part) for part in into)
        if size != len(header) + value_bytes:
            parsed = ChunkHeader.unpack(header[: os.preadv(fd, [header], 0)])
            if parsed.key == key and size == len(header) + parsed.value_bytes:
                return False  # a whole value of another length: a miss, not damage
            raise BadChunkFile(f"{size} bytes, its header says {len(header) + parsed.value_bytes}")
        got = _read_fully(fd, [memoryview(header), *into])
        if got != size:
            raise BadChunkFile(f"read {got} of {size} bytes")
        parsed = ChunkHeader.unpack(header)
        if parsed.key != key:
            raise BadChunkFile(f"it holds key {parsed.key!r}")
        if parsed.value_bytes != value_bytes or digest(into) != parsed.digest:
            raise BadChunkFile("its value does not match its header's digest")
        os.utime(fd)
        return True
    finally:
        os.close(fd)


def _write_fully(fd: int, views: list[bytes | memoryview]) -> None:
    offset = 0
    pending = [memoryview(v).cast("B") for v in views]
    while pending:
        written = os.pwritev(fd, pending[:_IOV_MAX], offset)
        if written <= 0:
            raise OSError(f"pwritev wrote {written} bytes at offset {offset}")
        offset += written
        pending = _advance(pending, written)


def _read_fully(fd: int, views: list[memoryview]) -> int:
    """Read into ``views`` from the file's start until they are full or the file ends; the bytes read."""
    offset = 0
    pending = [v.cast("B") for v in views]
    while pending:
        got = os.preadv(fd, pending[:_IOV_MAX], offset)
        if got == 0:
            break
        offset += got
        pending = _advance(pending, got)
    return offset


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """``views`` with their first ``done`` bytes dropped (a short ``preadv``/``pwritev``)."""
    rest = []
    for view in views:
        if done >= len(view):
            done -= len(view)
            continue
        rest.append(view[done:])
        done = 0
    return rest


def read_key(path: str | Path) -> str | None:
    """The key in the header of the file at ``path``, ``None`` for a file that is not a chunk file of
    this format (or is gone); reads the header only."""
    try:
        with open(path, "rb") as file:
            return ChunkHeader.unpack(file.read(_FIXED.size + MAX_KEY_BYTES)).key
    except (OSError, BadChunkFile):
        return None


def fsync_folder(folder: str) -> None:
    """Flush a folder's entries (a rename into it) to the device."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
