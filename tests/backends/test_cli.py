"""The ``kvcore`` command line: demo on a small shape, config check, and bench argument handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcore_cli.demo import DemoOptions, run_demo
from kvcore_cli.main import main


def test_demo_reuses_and_verifies_every_loaded_block() -> None:
    # a small model shape and a pool that cannot hold everything -> hits, evictions, all blocks verified
    options = DemoOptions(
        chats=6,
        turns=3,
        layers=2,
        kv_heads=2,
        head_size=64,
        engine_size="64MiB",
        pool_size="6MiB",
        progress=False,
    )
    summary = run_demo(options)
    assert summary.requests == 18
    assert summary.requests_with_hits > 0
    assert summary.cached_tokens > 0
    assert summary.verified_blocks == summary.cached_tokens // options.block_tokens
    assert summary.verified_ok
    assert summary.evictions > 0
    assert "byte for byte" in summary.render()


def test_config_check_prints_resolved_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"backend": {"kind": "cpu", "size": "1GiB"}}))
    assert main(["config", "check", str(path)]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["backend"] == {"kind": "cpu", "size": 1 << 30}
    assert resolved["chunk_tokens"] == 256


def test_config_check_names_the_bad_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"backend": {"kind": "cpu", "size": "-3GiB"}}))
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "backend.size" in err
    assert "-3GiB" in err


def test_bench_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "warp-drive"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_vllm_config_prints_pasteable_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-config", "--backend", "cpu", "--size", "4GiB"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kv_connector"] == "KVCoreConnector"
    assert printed["kv_connector_extra_config"] == {"backend": {"kind": "cpu", "size": "4GiB"}}
    assert main(["vllm-config", "--size", "lots"]) == 2
    assert "size" in capsys.readouterr().err
