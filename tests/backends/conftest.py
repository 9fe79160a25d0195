"""Fixtures shared by the backends' tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder every user may enter (``tmp_path``'s parents are root's alone)."""
    root = Path(tempfile.mkdtemp(prefix="kvcore-disk-"))
    root.chmod(0o777)
    yield root
    shutil.rmtree(root, ignore_errors=True)
