"""docs/writing-a-backend.md quotes the example backend as it is, and states its conformance run as it is:
every code block of the guide that names a file of the repository on its first line (``# path``) is that
file or a part of it, word for word, and the count the guide gives is the count a run gives."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "writing-a-backend.md"
BLOCK = re.compile(r"```python\n# ([\w/.-]+\.py)\n(.*?)```", re.S)


def test_every_quoted_file_is_quoted_as_it_is() -> None:
    quoted = BLOCK.findall(GUIDE.read_text())
    assert len(quoted) >= 5  # the store, the index, the conformance module, the config, the backend
    for path, body in quoted:
        source = (ROOT / path).read_text()
        assert body.rstrip() in source, f"docs/writing-a-backend.md quotes {path} as it no longer is"


def test_the_conformance_run_the_guide_states_is_the_run() -> None:
    stated = re.search(r"gives (\d+) passed and (\d+)\s+skipped", GUIDE.read_text())
    assert stated is not None
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/conformance/test_dirstore_conformance.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    summary = re.search(r"(\d+) passed, (\d+) skipped", run.stdout)
    assert summary is not None, run.stdout[-2000:]
    assert summary.groups() == stated.groups()
