"""Fail in a second: a config vLLM's engine would refuse is refused in vLLM's first process, before the
engine core starts and before any weights load, with the error the engine would raise; ``kvcore doctor``,
given the same config and model, gives the same verdict; and with the pre-flight turned off
(``KVCORE_PREFLIGHT=0``) the engine's own start refuses it with that same error."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcore.errors import ConfigError
from kvcore.plugins.preflight import EngineFlags, Report
from kvcore_cli.doctor import diagnose
from tests.integration.conftest import BLOCK, ENGINE_BLOCKS, MAX_MODEL_LEN, VLLM_MARKS

pytestmark = VLLM_MARKS

CACHE_BYTES = ENGINE_BLOCKS * BLOCK * 512  # the tiny Llama's 512 bytes of KV per token (start_engine's)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


CASES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "a key typo": lambda _: {"backend": {"kind": "cpu", "size": "64MiB"}, "chunk_token": 256},
    "an ambiguous size": lambda _: {"backend": {"kind": "cpu", "size": "64mb"}},
    "a missing path": lambda tmp: {
        "tiers": [
            {"kind": "cpu", "size": "64MiB"},
            {"kind": "disk", "path": str(tmp / "gone"), "size": "1GiB"},
        ]
    },
    "an uninstalled kind": lambda _: {"backend": {"kind": "redis", "size": "64MiB"}},
    "a pool below one chunk": lambda _: {"backend": {"kind": "cpu", "size": 8}},
    "a Mooncake master that is down": lambda _: {
        "backend": {"kind": "mooncake_store", "master": f"127.0.0.1:{_closed_port()}", "local_size": "64MiB"}
    },
    "an adapter key's bad value": lambda _: {
        "backend": {"kind": "cpu", "size": "64MiB"},
        "load_mode": "soon",
    },
}


def _transfer(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "KVCoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _doctor(model: Path, extra: dict[str, Any]) -> Report:
    flags = EngineFlags(model=str(model), cache_bytes=CACHE_BYTES)
    try:
        ((_, report),) = diagnose(_transfer(extra), flags)
    except ConfigError as exc:  # what the adapter refuses before any tier: a refusal all the same
        from kvcore.plugins.preflight import Finding

        return Report((Finding.refusal("config", exc),))
    return report


def _first_process(model: Path, extra: dict[str, Any]) -> None:
    """What vLLM's first process does with the config: build the engine's config (kvcore's plugin wraps
    that, and checks it) before any engine core starts."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model),
        enforce_eager=True,
        kv_cache_memory_bytes=CACHE_BYTES,
        kv_transfer_config=KVTransferConfig(**_transfer(extra)),
    )
    args.create_engine_config()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_doctor_and_vllms_first_process_refuse_alike(tiny_model: Path, tmp_path: Path, case: str) -> None:
    extra = CASES[case](tmp_path)
    (doctor,) = _doctor(tiny_model, extra).refusals
    with pytest.raises(ConfigError) as engine:
        _first_process(tiny_model, extra)
    assert type(engine.value).__name__ == "RefusedAtStart"
    assert (engine.value.field, engine.value.value, engine.value.expected) == (
        doctor.field,
        doctor.value,
        doctor.text,
    )


def test_a_server_that_is_down_is_a_warning_to_both_and_the_engine_config_is_built(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    extra = {"backend": {"kind": "lmcache_mp", "url": f"tcp://127.0.0.1:{_closed_port()}"}}
    report = _doctor(tiny_model, extra)
    assert not report.refusals
    (warning,) = report.warnings
    with caplog.at_level("WARNING", logger="kvcore_vllm"):
        _first_process(tiny_model, extra)
    assert f"kvcore pre-flight: {warning.line()}" in caplog.text


ENGINE_START_S = 180.0
"""How long the engine's own refusal may take. vLLM 0.32's engine core can hang after a worker failed its
start (seen once: it waited on a worker that had gone back to its loop): the refusal is on stderr by
then, and the process is killed."""


def test_without_the_preflight_the_engine_refuses_at_its_start_with_the_same_error(
    tiny_model: Path, tmp_path: Path
) -> None:
    extra = CASES["a missing path"](tmp_path)
    (doctor,) = _doctor(tiny_model, extra).refusals
    script = (
        "import json, sys\nfrom vllm import LLM\n"
        f"LLM(model={str(tiny_model)!r}, enforce_eager=True, kv_cache_memory_bytes={CACHE_BYTES}, "
        f"max_model_len={MAX_MODEL_LEN}, kv_transfer_config=json.loads(sys.argv[1]))"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(_transfer(extra))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # vLLM logs to stdout, tracebacks go to stderr
        text=True,
        cwd=tmp_path,
        env={**os.environ, "KVCORE_PREFLIGHT": "0"},
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=ENGINE_START_S)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the engine core and its workers too
        out, _ = process.communicate()
        hung = True
    assert process.returncode != 0
    assert doctor.line() in out  # the engine's own refusal, with the doctor's words
    if not hung:
        assert "Engine core initialization failed" in out


def test_the_server_stops_before_its_engine_core_starts_with_one_line(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = _transfer({"backend": {"kind": "cpu", "size": "64MiB"}, "chunk_token": 256})
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tiny_model),
            "--port",
            str(_closed_port()),
            "--kv-cache-memory-bytes",
            str(CACHE_BYTES),
            "--kv-transfer-config",
            json.dumps(config),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    took = time.monotonic() - started
    assert done.returncode != 0
    assert done.stderr.splitlines()[-2:] == [
        "kvcore: vLLM not started: chunk_token: got '<unknown key>', expected no such key (did you mean "
        "'chunk_tokens'?)",
        "  (kvcore doctor checks a config without starting vLLM)",
    ]
    assert "Traceback" not in done.stderr
    assert "EngineCore" not in done.stdout + done.stderr  # refused before vLLM read its arguments
    print(f"the server stopped {took:.1f} s after it started")  # measured, for the record
