"""Where a chunk's file lives, and writing one so that no reader ever sees half of it."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

from kvcore.ids import ChunkKey

__all__ = ["chunk_path", "write_atomically"]


def chunk_path(root: Path, key: ChunkKey) -> Path:
    """The file of ``key`` under ``root``: named by a digest of the key, so any key makes a safe name."""
    return root / hashlib.sha256(key.encode()).hexdigest()


def write_atomically(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it into place (atomic on POSIX):
    a reader finds the whole value or no file. Raises ``OSError``; no temporary file is left."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with temporary.open("wb") as file:
            file.write(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
