"""Build hook: compile the CPU backend's native row copier (``kvcore_cpu._rowcopy``) with the C compiler
Python was built with.

A wheel gets the module inside ``kvcore_cpu`` (and a platform tag); an editable install gets it beside
its source in ``backends/kvcore_cpu``, where the editable package is imported from.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.config import BuilderConfig
from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("backends/kvcore_cpu/_rowcopy.c")


class CustomBuildHook(BuildHookInterface[BuilderConfig]):
    """Compiles ``_rowcopy.c`` for the wheel target (standard and editable)."""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        name = "_rowcopy" + str(sysconfig.get_config_var("EXT_SUFFIX"))
        if version == "editable":
            _compile(Path(self.root) / SOURCE, Path(self.root) / SOURCE.parent / name)
            return
        self._scratch = tempfile.mkdtemp(prefix="kvcore-build-")
        out = Path(self._scratch) / name
        _compile(Path(self.root) / SOURCE, out)
        build_data["force_include"][str(out)] = f"kvcore_cpu/{name}"
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        """Remove the compiled module's scratch folder once the wheel holds it."""
        scratch = getattr(self, "_scratch", None)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _compile(source: Path, out: Path) -> None:
    compiler = shlex.split(os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc"))
    flags = ["-O3", "-shared", "-fPIC", "-I", sysconfig.get_paths()["include"]]
    command = [*compiler, *flags, str(source), "-o", str(out)]
    try:
        subprocess.run(command, check=True)
    except (OSError, subprocess.CalledProcessError) as error:
        raise RuntimeError(
            f"kvcore: compiling {source} failed ({error}); the CPU backend's row copier needs a C "
            "compiler and Python's headers (Debian: gcc python3-dev), or set CC"
        ) from error
