"""The disk tier's pre-flight (``kvcore_disk.preflight``): it refuses what ``ChunkDirectory.open`` refuses,
with the same error, without creating or changing anything; and it says what the folder holds. And the
servers' pre-flights where no server listens (their real servers: tests/mooncake, tests/lmcache)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvcore.errors import ConfigError
from kvcore.ids import ChunkKey
from kvcore.plugins.preflight import Finding, Verdict, preflight
from kvcore.ports import StoreItem
from kvcore_disk.directory import MARKER, ChunkDirectory
from kvcore_disk.store import DiskChunkStore
from tests.backends.other_user import as_nobody

GiB = 2**30


def _disk(path: Path, size: str | int = "1GiB") -> dict[str, object]:
    return {"tiers": [{"kind": "cpu", "size": "64MiB"}, {"kind": "disk", "path": str(path), "size": size}]}


def _findings(path: Path, size: str | int = "1GiB", *, deep: bool = False) -> list[Finding]:
    return list(preflight(_disk(path, size), deep=deep, memory=None).findings)


def _refusal_of_open(path: Path, size: int = GiB) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        ChunkDirectory.open(path, size, field="tiers[1].path", size_field="tiers[1].size")
    return info.value


@pytest.mark.parametrize("case", ["missing", "a file", "another format", "beyond its file system"])
def test_the_preflight_refuses_what_open_refuses_with_the_same_error(tmp_path: Path, case: str) -> None:
    path, size = tmp_path / "kv", GiB
    if case == "a file":
        path.write_text("not a folder")
    elif case == "another format":
        path.mkdir()
        (path / MARKER).write_text('{"format": 99}\n')
    elif case == "beyond its file system":
        path.mkdir()
        size = shutil.disk_usage(tmp_path).total + 1
    before = sorted(p.name for p in tmp_path.rglob("*"))
    (refusal,) = [f for f in _findings(path, size) if f.verdict is Verdict.REFUSED]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing created or changed
    engine = _refusal_of_open(path, size)
    assert (refusal.field, refusal.value, refusal.text) == (engine.field, engine.value, engine.expected)


def test_a_folder_another_user_may_not_use_is_refused_naming_the_cause(shared_tmp: Path) -> None:
    root = shared_tmp / "kv"
    root.mkdir()
    ChunkDirectory.open(root, GiB)  # root's marker, folders and usage.lock (0600)
    for folder in [root, *root.rglob("*")]:
        if folder.is_dir():
            folder.chmod(0o777)

    def both() -> str:
        (refusal,) = [f for f in _findings(root) if f.verdict is Verdict.REFUSED]
        engine = _refusal_of_open(root)
        return f"{refusal.field == engine.field and refusal.text == engine.expected} | {refusal.text}"

    said = as_nobody(both)
    assert said.startswith("True | a directory this process can use (Permission denied")
    assert "usage.lock" in said


def test_a_new_folder_passes_and_says_it_holds_nothing(tmp_path: Path) -> None:
    findings = _findings(tmp_path)
    assert not [f for f in findings if f.verdict is not Verdict.OK]
    assert [f.text for f in findings if f.check == "chunks"] == ["a new tier: no chunks yet"]
    assert os.listdir(tmp_path) == []  # the pre-flight wrote no marker


def test_a_size_beyond_what_the_disk_gives_now_is_a_warning_as_at_open(tmp_path: Path) -> None:
    usage = shutil.disk_usage(tmp_path)
    if usage.total - usage.free < GiB:
        pytest.skip("the file system is nearly empty: no size lies between its free space and its total")
    (warning,) = [f for f in _findings(tmp_path, usage.free + GiB // 2) if f.verdict is Verdict.WARNING]
    assert warning.field == "tiers[1].size"
    assert "saves that find the disk full are dropped" in warning.text


def test_a_deep_look_counts_the_chunk_files_by_namespace(tmp_path: Path) -> None:
    host = bytearray(4 * 4096)
    store = DiskChunkStore(ChunkDirectory.open(tmp_path, GiB), memoryview(host))
    try:
        keys = ["kv/aaaa1111/s0/c1", "kv/aaaa1111/s0/c2", "kv/bbbb2222/s0/c1"]
        job = store.submit_put([StoreItem(ChunkKey(key), i * 4096, 4096) for i, key in enumerate(keys)])
        assert store.wait([job], 10.0)[0].failed == ()
    finally:
        store.close()
    (tmp_path / "chunks" / "00" / "stray").write_bytes(b"not a chunk file")
    (cheap,) = [f.text for f in _findings(tmp_path) if f.check == "chunks"]
    assert cheap.endswith("of chunk files")
    (deep,) = [f.text for f in _findings(tmp_path, deep=True) if f.check == "chunks"]
    assert deep == "3 chunk files in 2 namespaces: aaaa1111 (2), bbbb2222 (1); 1 not chunk files"


def test_a_master_nobody_listens_at_is_refused_as_the_engine_refuses_it() -> None:
    data = {"backend": {"kind": "mooncake_store", "master": "127.0.0.1:9", "local_size": "64MiB"}}
    (refusal,) = preflight(data, memory=None, timeout_s=1.0).refusals
    assert (refusal.field, refusal.value) == ("backend.master", "127.0.0.1:9")
    assert "connection refused" in refusal.text


def test_an_lmcache_server_that_does_not_answer_is_a_warning() -> None:
    report = preflight(
        {"backend": {"kind": "lmcache_mp", "url": "tcp://127.0.0.1:9"}}, memory=None, timeout_s=1.0
    )
    assert not report.refusals
    (warning,) = report.warnings
    assert warning.field == "backend.url"
    assert "every lookup misses until one answers" in warning.text
