"""The ``kvcore`` command line: demo on a small shape, config check, and bench argument handling."""

from __future__ import annotations

import json
import subprocess
import sys
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


def test_vllm_config_puts_a_disk_tier_behind_the_pool(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-config", "--size", "4GiB", "--disk", "/nvme/kv", "--disk-size", "1TiB"]) == 0
    extra = json.loads(capsys.readouterr().out)["kv_connector_extra_config"]
    assert extra == {
        "tiers": [{"kind": "cpu", "size": "4GiB"}, {"kind": "disk", "path": "/nvme/kv", "size": "1TiB"}]
    }
    args = ["vllm-config", "--backend", "mooncake", "--disk", "/nvme/kv", "--disk-size", "1TiB"]
    assert main(args) == 0
    tiers = json.loads(capsys.readouterr().out)["kv_connector_extra_config"]["tiers"]
    assert [t["kind"] for t in tiers] == ["cpu", "disk", "mooncake_store"]
    assert tiers[0]["size"] == "8GiB"
    assert main([*args, "--disk-write", "back"]) == 0
    tiers = json.loads(capsys.readouterr().out)["kv_connector_extra_config"]["tiers"]
    assert [t.get("write") for t in tiers] == [None, "back", None]
    assert main([*args, "--disk-write", "sometimes"]) == 2
    assert "tiers[1].write: got 'sometimes'" in capsys.readouterr().err
    assert main(["vllm-config", "--disk", "/nvme/kv"]) == 2
    assert "disk_size: got None" in capsys.readouterr().err
    assert main(["vllm-config", "--backend", "lmcache", "--disk", "/kv", "--disk-size", "1GiB"]) == 2
    assert "disk: got '/kv'" in capsys.readouterr().err


DEEP = "[" * 100_000 + "]" * 100_000

BAD_FILES = [
    pytest.param(
        b'{"backend": {"kind": "cpu", "size": "1GiB"}, "epoch": "\xff\xfe"}', "UTF-8", id="not-utf8"
    ),
    pytest.param(('{"backend": ' + DEEP + "}").encode(), "nested", id="deep"),
    pytest.param(b'{"chunk_tokens": ' + b"9" * 5000 + b"}", "5000 digits", id="huge-int"),
    pytest.param(b'{"backend": {"kind": "cpu", "size": 1}, "lookup_timeout_s": NaN}', "NaN", id="nan"),
    pytest.param(
        b'{"backend": {"kind": "cpu", "size": 1}, "lookup_timeout_s": -Infinity}', "Infinity", id="inf"
    ),
    pytest.param(b'{"backend": {"kind": "cpu", "size": 1, "size": "9GiB"}}', "'size'", id="duplicate-key"),
    pytest.param(b'{"backend": {"kind": "cpu", "size": 1}, "backend": 2}', "'backend'", id="duplicate-top"),
    pytest.param(b'[{"backend": {"kind": "cpu", "size": 1}}]', "JSON object", id="top-level-array"),
    pytest.param(b'"cpu"', "JSON object", id="top-level-string"),
    pytest.param(b"", "empty", id="empty"),
    pytest.param(b"  \n", "empty", id="blank"),
    pytest.param(b"{not json", "valid JSON", id="syntax"),
    pytest.param(
        b'{"backend": {"kind": "cpu", "size": 1}, "lookup_timeout_s": 1e999}', "lookup_timeout_s", id="1e999"
    ),
    pytest.param(
        b'{"backend": {"kind": "cpu", "size": 1}, "epoch": "\\ud800"}', "epoch", id="lone-surrogate"
    ),
    pytest.param(
        b'{"backend": {"kind": "cpu", "size": "1GiB"}, "pd": {"port": 65536}}', "pd.port", id="pd-port"
    ),
    pytest.param(
        b'{"backend": {"kind": "cpu", "size": 1}, "chunk_tokens": ' + b"9" * 40 + b"}",
        "chunk_tokens",
        id="big-int",
    ),
]


@pytest.mark.parametrize(("content", "named"), BAD_FILES)
def test_config_check_refuses_bad_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, named: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    assert main(["config", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert named in err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1


def test_config_check_refuses_a_directory_and_a_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "check", str(tmp_path)]) == 2
    assert "directory" in capsys.readouterr().err
    assert main(["config", "check", str(tmp_path / "missing.json")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_config_check_accepts_a_byte_order_mark(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"backend": {"kind": "cpu", "size": 1}}).encode())
    assert main(["config", "check", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == {"kind": "cpu", "size": 1}


def test_the_installed_command_exits_2_without_a_traceback(tmp_path: Path) -> None:
    kvcore = Path(sys.executable).with_name("kvcore")
    for name, content in (("deep.json", DEEP.encode()), ("dup.json", b'{"a": 1, "a": 2}')):
        path = tmp_path / name
        path.write_bytes(content)
        done = subprocess.run(
            [kvcore, "config", "check", str(path)], capture_output=True, text=True, check=False
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert "config_file" in done.stderr
