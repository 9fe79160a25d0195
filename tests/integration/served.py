"""The integration tests' served engine: ``benchmarks.served``'s server with the tests' engine settings."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.served import ServedEngine, Stopped, free_port, session_processes

__all__ = [
    "KV_BYTES_PER_TOKEN",
    "READY_TIMEOUT_S",
    "ServedEngine",
    "Stopped",
    "free_port",
    "quick_serve_rows",
    "serve",
    "session_processes",
]

CHECKOUT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 300.0  # about 20 s on an idle machine; much more on 2 cores shared with other engines
KV_BYTES_PER_TOKEN = 512  # the tiny model: 2 layers x 2 KV heads x 32 x (K, V) x bf16


@contextlib.contextmanager
def serve(
    vllm_env: Path,
    model: Path,
    log_path: Path,
    kv_transfer_config: Mapping[str, Any],
    *,
    kv_cache_tokens: int,
    max_model_len: int,
    python_path: Sequence[Path] = (),
) -> Iterator[ServedEngine]:
    """A server with the integration tests' engine settings (a KV cache of ``kv_cache_tokens`` that vLLM
    must evict from, eager mode, seed 0), ready; stopped when the block is left. ``python_path`` goes
    in front of the server's ``PYTHONPATH`` (where a plugin is installed)."""
    dropped = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ALLOW_INSECURE_SERIALIZATION")  # the server needs neither
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(
        VLLM_CACHE_ROOT=str(vllm_env / "cache"), TMPDIR=str(vllm_env), VLLM_CPU_NUM_OF_RESERVED_CPU="1"
    )
    if python_path:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, python_path), env.get("PYTHONPATH", "")])
    server = ServedEngine(
        model,
        log_path,
        kv_transfer_config,
        args=[
            "--max-model-len",
            str(max_model_len),
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(kv_cache_tokens * KV_BYTES_PER_TOKEN),
            "--seed",
            "0",
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
            "--disable-uvicorn-access-log",
        ],
        env=env,
    )
    try:
        server.wait_ready(READY_TIMEOUT_S)
        yield server
    finally:
        server.stop()


def quick_serve_rows(tmp_path: Path, flags: Sequence[str], timeout_s: float) -> dict[tuple[str, str], Any]:
    """Run ``kvcore bench serve --quick -- <flags>`` as a user does; its rows by (workload, config),
    after checking that it exited 0 and printed its tables."""
    figures = tmp_path / "serve.json"
    argv = [sys.executable, "-m", "kvcore_cli.main", "bench", "serve", "--quick", "--", *flags]
    done = subprocess.run(
        [*argv, "--json", str(figures)],
        check=False,
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "workload config" in done.stdout
    assert "tok/s vs vLLM" in done.stdout
    return {(row["workload"], row["config"]): row for row in json.loads(figures.read_text())["rows"]}
