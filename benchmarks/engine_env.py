"""The environment every vLLM benchmark runs its engine in: a scratch folder of its own, and one CPU kept
for the engine's other threads, so that every figure comes from the same threads; and, for benchmarks
with Mooncake clients (which listen on every interface), a loopback-only network namespace."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["in_loopback_namespace", "loopback_only", "vllm_scratch"]

_REEXEC = "KVCORE_BENCH_REEXEC"  # set in the re-executed process: it never re-executes again


def in_loopback_namespace() -> bool:
    """True when the only network interface is ``lo`` (a namespace made by ``unshare -n``)."""
    # /proc/net/dev follows the caller's namespace (sysfs keeps showing the host's interfaces).
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return [line.split(":", 1)[0].strip() for line in lines] == ["lo"]


def loopback_only(module: str, argv: list[str]) -> int | None:
    """``None`` inside a loopback-only network namespace; outside one, re-execute ``python -m module argv``
    under ``unshare -n`` (which needs root): it does not return then; 2 (after saying so) where
    ``unshare`` is missing, or where the re-executed process is still outside one."""
    if in_loopback_namespace():
        return None
    if shutil.which("unshare") is not None and os.environ.get(_REEXEC) != "1":
        os.environ[_REEXEC] = "1"
        inner = shlex.join([sys.executable, "-m", module, *argv])
        os.execvp("unshare", ["unshare", "-n", "sh", "-c", f"ip link set lo up; exec {inner}"])
    print("needs a loopback-only network namespace: run under unshare -n (util-linux)", file=sys.stderr)
    return 2


def vllm_scratch(prefix: str) -> Path | None:
    """Prepare the environment and return a fresh scratch folder, or ``None`` (after saying so) when vLLM
    is not installed."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.update(VLLM_CACHE_ROOT=str(root / "cache"), TMPDIR=str(root), VLLM_CPU_NUM_OF_RESERVED_CPU="1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM is not installed: nothing to measure")
        return None
    return root
