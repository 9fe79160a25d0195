"""The ``kvcore`` command line: the demo on a small shape (its workload, its token accounting, its JSON
and picture), config check, and bench's listing and argument handling."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from kvcore.errors import ConfigError
from kvcore_cli.bench import BENCHMARKS, is_native_log
from kvcore_cli.demo import DemoOptions, DemoSummary, DemoWorkload, run_demo
from kvcore_cli.main import main

# a small model shape and a pool that cannot hold everything -> hits, evictions, all blocks verified
SMALL = DemoOptions(
    chats=6,
    turns=3,
    layers=2,
    kv_heads=2,
    head_size=64,
    engine_size="64MiB",
    pool_size="6MiB",
    progress=False,
)
SMALL_ARGS = [
    *("--chats", "6", "--turns", "3", "--layers", "2", "--kv-heads", "2", "--head-size", "64"),
    *("--engine-size", "64MiB", "--pool-size", "6MiB", "--no-progress"),
]
CHECKOUT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_run() -> DemoSummary:
    return run_demo(DemoWorkload.build(SMALL))


def test_demo_reuses_and_verifies_every_loaded_block(small_run: DemoSummary) -> None:
    assert len(small_run.requests) == 18
    assert small_run.requests_served_from_kvcore > 0
    assert small_run.served_tokens > 0
    assert small_run.verified_blocks == small_run.served_tokens // SMALL.block_tokens
    assert small_run.verified_ok
    assert small_run.evictions > 0
    assert "byte for byte" in small_run.render()


def test_demo_prompt_tokens_are_served_plus_computed(small_run: DemoSummary) -> None:
    turns = small_run.workload.turns
    prompt, served, computed = small_run.prompt_tokens, small_run.served_tokens, small_run.computed_tokens
    assert prompt == sum(len(t.prompt) for t in turns)
    assert served + computed == prompt
    assert small_run.answer_tokens == sum(len(t.answer) for t in turns)
    for r in small_run.requests:
        assert r.served_tokens + r.computed_tokens == r.prompt_tokens
        assert 0 <= r.served_tokens <= r.prompt_tokens
    per_turn = small_run.per_turn
    assert [t.turn for t in per_turn] == [1, 2, 3]
    assert sum(t.prompt_tokens for t in per_turn) == prompt
    assert sum(t.served_tokens for t in per_turn) == served
    assert small_run.loaded_bytes == served * small_run.workload.kv_bytes_per_token
    text = small_run.render()
    assert f"{prompt:,} = {served:,} served from kvcore" in text
    assert f"+ {computed:,} computed" in text
    assert f"without kvcore        {prompt:,} computed" in text


def test_demo_states_its_workload(small_run: DemoSummary) -> None:
    workload = small_run.workload
    # 2 layers x 2 heads x (K + V) x 64 x 2 bytes; 64 MiB of 16-token blocks; 6 MiB of 256-token chunks
    assert workload.kv_bytes_per_token == 1024
    assert workload.engine_blocks == 4096
    assert workload.pool_chunks == 24 == small_run.pool_capacity  # what the CPU backend really made
    text = workload.render()
    assert "6 (4 chats, 2 agents) x 3 turns = 18 requests" in text
    assert "2 layers x 2 KV heads x 64 head size, bf16: 1 KiB of KV per token" in text
    assert "0.06 GiB = 4,096 blocks of 16 tokens (65,536 tokens)" in text
    assert "= 24 chunks of 256 tokens (6,144 tokens)" in text
    lengths = [len(t.prompt) for t in workload.turns]
    assert f"{sum(lengths):,} tokens, {min(lengths):,} to {max(lengths):,} per request" in text
    assert "6 conversations x 3 turns; 1 KiB of KV a token" in small_run.render()


def test_demo_refuses_a_workload_that_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    # 1 MiB holds 1,024 tokens of 1 KiB: shorter than every request, which would wait forever for blocks
    with pytest.raises(ConfigError, match=r"engine_size: got '1MiB', expected room for the longest request"):
        DemoWorkload.build(attrs.evolve(SMALL, engine_size="1MiB"))
    with pytest.raises(ConfigError, match="pool_size: got '100KiB', expected at least one chunk"):
        DemoWorkload.build(attrs.evolve(SMALL, pool_size="100KiB"))
    assert main(["demo", *SMALL_ARGS, "--turns", "0"]) == 2
    assert "turns: got 0" in capsys.readouterr().err


def test_demo_writes_its_figures_as_json_and_draws_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures, picture = tmp_path / "demo.json", tmp_path / "demo.png"
    assert main(["demo", *SMALL_ARGS, "--json", str(figures), "--plot", str(picture)]) == 0
    out = capsys.readouterr().out
    assert out.index("kvcore demo workload") < out.index("kvcore demo summary")
    data = json.loads(figures.read_text())
    totals = data["totals"]
    assert totals["served_tokens"] + totals["computed_tokens"] == totals["prompt_tokens"]
    assert totals["prompt_tokens"] == data["workload"]["prompt_tokens"]
    assert totals["answer_tokens"] == data["workload"]["answer_tokens"]
    assert data["without_kvcore"]["computed_tokens"] == totals["prompt_tokens"]
    assert data["without_kvcore"]["prefill_avoided"] == totals["served_tokens"] / totals["prompt_tokens"]
    assert sum(t["computed_tokens"] for t in data["per_turn"]) == totals["computed_tokens"]
    assert len(data["requests"]) == totals["requests"] == 18
    assert sum(r["served_tokens"] for r in data["requests"]) == totals["served_tokens"]
    assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_demo_plot_names_matplotlib_when_it_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, module, None)  # what an import finds when it is not installed
    picture = tmp_path / "demo.png"
    assert main(["demo", *SMALL_ARGS, "--plot", str(picture)]) == 2
    out, err = capsys.readouterr()
    assert "matplotlib, which is not installed: pip install matplotlib" in err
    assert "kvcore demo workload" not in out  # refused before the run
    assert not picture.exists()


def test_config_check_is_the_doctor_and_says_what_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"backend": {"kind": "cpu", "size": "1GB"}}))
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "runs: tiers: cpu (size 1GB = 953.67 MiB); chunks of 256 tokens" in out
    assert "=> the engine would start" in out


def test_config_check_names_the_bad_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"backend": {"kind": "cpu", "size": "-3GiB"}}))
    assert main(["config", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "REFUSED  config  backend.size  got '-3GiB'" in out
    assert "=> the engine would refuse this config" in out


def test_bench_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "warp-drive"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_bench_lists_every_benchmark_with_its_baseline_and_legend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if not line.startswith(" ")] == list(BENCHMARKS)
    assert sum(line.startswith("  baseline: ") for line in lines) == len(BENCHMARKS)
    assert sum(line.startswith("  legend: ") for line in lines) == len(BENCHMARKS)
    for name, bench in BENCHMARKS.items():
        script = (CHECKOUT / bench.module.replace(".", "/")).with_suffix(".py").read_text()
        if "'ratio'" in script:  # a column headed "ratio": its legend says what it divides
            assert "ratio = " in bench.legend, name
        if re.search(r"mooncake_master|TransferEngine|lmcache_server|from vllm import LLM", script):
            assert bench.starts, name  # a benchmark that starts a server or an engine says so


def test_bench_help_names_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name, bench in BENCHMARKS.items():
        assert f"{name}: {bench.measures}" in out


def test_bench_tells_mooncake_log_lines_from_the_figures() -> None:
    # lines Mooncake's native code wrote during a run of pd-transfer and mooncake-store
    assert is_native_log("WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
    assert is_native_log(
        "I1206 04:26:01.928040 32399 transfer_engine_impl.cpp:1046] Metrics reporting is disabled\n"
    )
    assert is_native_log(
        "E1206 04:26:07.295962 32508 transfer_metadata.cpp:1098] Local segment descriptor not found"
    )
    assert not is_native_log("warning: reuse of 2048 tokens found only 1920 cached\n")
    assert not is_native_log("Traceback (most recent call last):\n")
    assert not is_native_log("MooncakePeerTransport                   0.53      0.26      1.45\n")


def test_bench_runs_a_benchmark_in_its_own_process_after_its_legend(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "hashing", "--quick"]) == 0
    out = capfd.readouterr().out
    legend = out.index("  legend: x vLLM@16 = ")
    assert out.index("## hashing: chunk hashing") < legend < out.index("x vLLM@16  x vLLM same")


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
    args = ["vllm-config", "--backend", "mooncake_store", "--disk", "/nvme/kv", "--disk-size", "1TiB"]
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
    assert main(["vllm-config", "--backend", "lmcache_mp", "--disk", "/kv", "--disk-size", "1GiB"]) == 2
    assert "disk: got '/kv'" in capsys.readouterr().err


def test_vllm_config_takes_the_config_kinds_and_refuses_what_it_would_ignore(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["vllm-config", "--backend", "mooncake"]) == 2
    assert "backend: got 'mooncake'" in (err := capsys.readouterr().err)
    assert "'mooncake_store'?" in err
    assert main(["vllm-config", "--disk-write", "back"]) == 2  # no disk: the write mode would be ignored
    assert "disk: got None" in capsys.readouterr().err
    assert main(["vllm-config", "--disk-size", "1TiB"]) == 2
    assert main(["vllm-config", "--endpoint", "h:1"]) == 2  # the cpu tier has no endpoint
    assert "endpoint" in capsys.readouterr().err
    assert main(["vllm-config", "--backend", "lmcache_mp"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_connector_extra_config"]["backend"]["kind"] == "lmcache_mp"


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
]


BAD_CONTENT = [
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
"""Files that read, holding what the engine refuses: the doctor's table says so (exit 1)."""


@pytest.mark.parametrize(("content", "named"), BAD_CONTENT)
def test_config_check_refuses_what_the_engine_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, named: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    assert main(["config", "check", str(path)]) == 1
    refused = [line for line in capsys.readouterr().out.splitlines() if "REFUSED" in line]
    assert len(refused) == 1
    assert named in refused[0]


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
    assert "=> the engine would start" in capsys.readouterr().out


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


def test_bench_hands_flags_after_the_name_to_that_benchmark(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--", "--help"]) == 0
    assert "--workloads" in capfd.readouterr().out  # bench_serve's own help
    assert main(["bench", "hashing", "pool", "--", "--quick"]) == 2
    assert "name exactly one" in capfd.readouterr().err


def test_bench_runs_the_long_benchmarks_only_when_named() -> None:
    assert [name for name, bench in BENCHMARKS.items() if bench.by_name_only] == [
        "cross-tp-ttft",
        "pd-turns",
        "serve",
    ]
