"""The environment every vLLM benchmark runs its engine in: a scratch folder of its own, and one CPU kept
for the engine's other threads, so that every figure comes from the same threads."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["vllm_scratch"]


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
