"""The disk tier's own promises, beyond the ``ChunkStore`` contract (tests/conformance): damaged files are
misses that go away, chunks survive a new process, the directory is checked at open, several processes
share one folder within its size, LRU follows reads, a full disk drops saves, and a writer killed mid-save
leaves only whole chunks."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcore.errors import ConfigError
from kvcore.ids import ChunkKey
from kvcore.ports import StoreItem, TierUsage
from kvcore_disk.chunk_file import file_bytes, header_bytes
from kvcore_disk.directory import LOCK_WAIT_S, MARKER, ChunkDirectory
from kvcore_disk.index import DiskChunkIndex
from kvcore_disk.store import DiskChunkStore
from tests.backends.other_user import as_nobody

VALUE = 8192
FILE = file_bytes("kv/0", VALUE)  # every key here is short: a 40-byte header
HOST = 16 * VALUE
TIMEOUT_S = 10.0


class Tier:
    """A store over a host buffer of 16 values, on ``root``."""

    def __init__(self, root: Path, size: int = 64 * FILE) -> None:
        self.directory = ChunkDirectory.open(root, size)
        self.host = bytearray(HOST)
        self.store = DiskChunkStore(self.directory, memoryview(self.host))

    def put(self, key: str, value: bytes, slot: int = 0) -> bool:
        self.host[slot * VALUE : slot * VALUE + len(value)] = value
        job = self.store.submit_put([StoreItem(ChunkKey(key), slot * VALUE, len(value))])
        (result,) = self.store.wait([job], TIMEOUT_S)
        return result.ok

    def get(self, key: str, length: int = VALUE, slot: int = 0) -> bytes | None:
        self.host[slot * VALUE : slot * VALUE + length] = bytes(length)
        job = self.store.submit_get([StoreItem(ChunkKey(key), slot * VALUE, length)])
        (result,) = self.store.wait([job], TIMEOUT_S)
        return bytes(self.host[slot * VALUE : slot * VALUE + length]) if result.ok else None

    def close(self) -> None:
        self.store.close()


def value(seed: int, length: int = VALUE) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(length))


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[Tier]:
    t = Tier(tmp_path)
    yield t
    t.close()


def test_round_trip_and_a_new_process_reads_what_the_last_one_wrote(tmp_path: Path) -> None:
    first = Tier(tmp_path)
    assert first.put("kv/a", value(1))
    first.close()
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from kvcore.ids import ChunkKey
        from kvcore.ports import StoreItem, TierUsage
        from kvcore_disk.directory import ChunkDirectory
        from kvcore_disk.index import DiskChunkIndex
        from kvcore_disk.store import DiskChunkStore
        directory = ChunkDirectory.open(Path({str(tmp_path)!r}), {64 * FILE})
        assert DiskChunkIndex(directory).lookup([[ChunkKey("kv/a")], [ChunkKey("kv/b")]]) == 1
        host = bytearray({VALUE})
        store = DiskChunkStore(directory, memoryview(host))
        (result,) = store.wait([store.submit_get([StoreItem(ChunkKey("kv/a"), 0, {VALUE})])], 10)
        store.close()
        print(result.ok, host.hex())
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", value(1).hex()]


@pytest.mark.parametrize(
    "damage",
    [
        "truncated value",
        "truncated header",
        "flipped value byte",
        "flipped header byte",
        "another key's file",
    ],
)
def test_a_damaged_file_is_a_miss_and_is_removed(
    tier: Tier, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert tier.put("kv/a", value(1))
    assert tier.put("kv/b", value(2))
    path = tier.directory.path("kv/a")
    data = bytearray(path.read_bytes())
    if damage == "truncated value":
        data = data[:-100]
    elif damage == "truncated header":
        data = data[:100]
    elif damage == "flipped value byte":
        data[header_bytes("kv/a") + 1234] ^= 0x10
    elif damage == "flipped header byte":
        data[12] ^= 0x01  # the header's size field
    else:
        data = bytearray(tier.directory.path("kv/b").read_bytes())
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="kvcore_disk.store"):
        assert tier.get("kv/a") is None
    assert "is not a whole chunk" in caplog.text
    deadline = time.monotonic() + TIMEOUT_S
    while path.exists():  # removed behind the puts, off the read's path
        assert time.monotonic() < deadline, "the damaged file was never removed"
        time.sleep(0.01)
    assert tier.get("kv/b") == value(2)  # the other chunk is untouched
    assert tier.put("kv/a", value(1))  # and the key can be saved again
    assert tier.get("kv/a") == value(1)


def test_a_value_of_another_length_is_a_miss_and_stays(tier: Tier) -> None:
    assert tier.put("kv/a", value(1, 4096))
    assert tier.get("kv/a", length=VALUE) is None
    assert tier.directory.path("kv/a").exists()
    assert tier.get("kv/a", length=4096) == value(1, 4096)


def test_reads_bump_a_chunk_so_eviction_takes_the_least_recently_used(tmp_path: Path) -> None:
    t = Tier(tmp_path, size=4 * FILE)
    try:
        for i in range(4):
            assert t.put(f"kv/{i}", value(i))
            time.sleep(0.01)  # distinct modification times
        assert t.get("kv/0") == value(0)  # the oldest write, now the most recent read
        assert t.put("kv/4", value(4))  # over the size: evict down to 90 % -> two files go
        present = [i for i in range(5) if t.directory.path(f"kv/{i}").exists()]
        assert present == [0, 3, 4]
        assert t.directory.usage() == 3 * FILE
        assert t.directory.evicted_files == 2
        assert DiskChunkIndex(t.directory).usage() == TierUsage(3 * FILE, 4 * FILE, evictions=2)
    finally:
        t.close()


def test_a_stray_entry_in_the_folder_stops_neither_scans_nor_eviction(tmp_path: Path) -> None:
    t = Tier(tmp_path, size=4 * FILE)
    try:
        stray = t.directory.path("kv/stray")
        stray.mkdir()  # a folder where a chunk file would be
        (stray.parent / "link").symlink_to("/etc/hostname")
        for i in range(6):  # past the size twice: two evictions walk past the stray entries
            assert t.put(f"kv/{i}", value(i))
            time.sleep(0.01)
        assert t.directory.usage() <= 4 * FILE
        assert t.directory.scan().files == len([i for i in range(6) if t.directory.path(f"kv/{i}").exists()])
        assert stray.is_dir()
    finally:
        t.close()


def test_open_refuses_bad_directories_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"backend.path: got '.*missing', expected an existing directory"):
        ChunkDirectory.open(tmp_path / "missing", 2**20)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="expected a directory"):
        ChunkDirectory.open(tmp_path / "file", 2**20)
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ConfigError, match=r"backend.size: got \d+, expected at most the \d+ bytes"):
        ChunkDirectory.open(tmp_path, free + 2**40)
    other = tmp_path / "other"
    other.mkdir()
    (other / MARKER).write_text(json.dumps({"format": 99}))
    with pytest.raises(
        ConfigError, match=r"format 1, but its kvcore-disk\.json says .*another kvcore version"
    ):
        ChunkDirectory.open(other, 2**20)


def _open_as_nobody(root: Path) -> str:
    """What opening ``root`` says in a process of ``nobody``."""

    def open_it() -> str:
        try:
            ChunkDirectory.open(root, 2**20)
        except ConfigError as exc:
            return f"{exc.field} | {exc.value} | {exc.expected}"
        return "opened"

    return as_nobody(open_it)


def test_a_path_the_system_refuses_is_a_config_error_naming_the_path_and_the_cause(tmp_path: Path) -> None:
    too_long_name = tmp_path / ("x" * 300)  # a component over NAME_MAX (255 bytes)
    with pytest.raises(ConfigError, match=r"backend.path: got '.*x{300}', expected .*File name too long"):
        ChunkDirectory.open(too_long_name, 2**20)
    deep = tmp_path / "/".join(["y" * 200] * 25)  # over PATH_MAX (4096 bytes)
    with pytest.raises(ConfigError, match=r"backend.path: .*File name too long"):
        ChunkDirectory.open(deep, 2**20)


def test_a_folder_this_user_may_not_enter_is_a_config_error(shared_tmp: Path) -> None:
    closed = shared_tmp / "closed"
    (closed / "kv").mkdir(parents=True)
    closed.chmod(0o700)  # root's: nobody may not enter it
    said = _open_as_nobody(closed / "kv")
    assert said.startswith(f"backend.path | {closed / 'kv'} | ")
    assert "Permission denied" in said


def test_a_lock_file_of_another_user_is_a_config_error(shared_tmp: Path) -> None:
    root = shared_tmp / "kv"
    root.mkdir()
    root.chmod(0o777)
    ChunkDirectory.open(root, 2**20)  # root's marker, folders and usage.lock (0600)
    for folder in [root, *root.rglob("*")]:
        if folder.is_dir():
            folder.chmod(0o777)
    said = _open_as_nobody(root)
    assert said.startswith(f"backend.path | {root} | a directory this process can use (Permission denied")
    assert "usage.lock" in said


def test_a_smaller_size_at_restart_evicts_the_least_recently_used_at_open(tmp_path: Path) -> None:
    t = Tier(tmp_path, size=16 * FILE)
    for i in range(8):
        assert t.put(f"kv/{i}", value(i))
        time.sleep(0.01)  # distinct modification times
    t.close()
    again = Tier(tmp_path, size=4 * FILE)
    try:
        assert again.directory.usage() <= 4 * FILE  # at open, before any save
        present = [i for i in range(8) if again.directory.path(f"kv/{i}").exists()]
        assert present == [5, 6, 7]  # down to 90 % of the size, the most recent kept
        assert again.directory.evicted_files == 5
        assert again.get("kv/7") == value(7)
    finally:
        again.close()


LOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
os.kill(os.getpid(), 19)  # SIGSTOP: frozen, holding the lock
"""


def test_a_frozen_process_holding_the_lock_delays_no_load_and_drops_saves_in_bounded_time(
    tier: Tier, caplog: pytest.LogCaptureFixture
) -> None:
    assert tier.put("kv/a", value(1))
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(tier.directory.lock_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        tier.host[VALUE : 2 * VALUE] = value(2)
        put = tier.store.submit_put([StoreItem(ChunkKey("kv/b"), VALUE, VALUE)])  # waits for the lock
        time.sleep(0.2)  # the put is running, its commit waiting
        get = tier.store.submit_get([StoreItem(ChunkKey("kv/a"), 0, VALUE)])
        (got,) = tier.store.wait([get], TIMEOUT_S)
        assert got.ok
        assert time.monotonic() - started < 1.0  # the load did not queue behind the save
        assert bytes(tier.host[:VALUE]) == value(1)
        with caplog.at_level(logging.WARNING, logger="kvcore.kit.repeats"):
            (saved,) = tier.store.wait([put], TIMEOUT_S)
        assert saved.failed == (0,)  # dropped after the lock wait, not held forever
        assert time.monotonic() - started < LOCK_WAIT_S + 1.0
        assert "chunks not saved: LockBusy" in caplog.text
        assert not tier.directory.path("kv/b").exists()
        assert not list((tier.directory.root / "chunks").rglob(".*"))  # its temporary is gone
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert holder.stdout is not None
        holder.stdout.close()
    assert tier.put("kv/b", value(2))  # the lock is free again: saves go on


def test_start_up_counts_the_chunks_and_removes_only_dead_writers_temporaries(tmp_path: Path) -> None:
    t = Tier(tmp_path)
    for i in range(3):
        assert t.put(f"kv/{i}", value(i))
    t.close()
    folder = t.directory.path("kv/0").parent
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=False, capture_output=True, text=True
    )
    orphan = folder / f".x.{int(dead.stdout)}.0123456789ab.tmp"
    live = folder / f".y.{os.getpid()}.0123456789ab.tmp"
    stale = folder / f".z.{os.getpid()}.0123456789ab.tmp"  # a live process id, but hours old
    orphan.write_bytes(b"half")
    live.write_bytes(b"being written")
    stale.write_bytes(b"left by a writer in another container")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    (tmp_path / "usage.lock").write_bytes(bytes(8))  # a counter lost: the scan rebuilds it
    again = ChunkDirectory.open(tmp_path, 64 * FILE)
    assert again.usage() == 3 * FILE
    assert not orphan.exists()
    assert not stale.exists()
    assert live.exists()


def test_two_writers_sharing_a_folder_stay_within_its_size_and_never_evict_twice(tmp_path: Path) -> None:
    size = 20 * FILE
    writers = [Tier(tmp_path, size) for _ in range(2)]  # two opens of the folder, as two engines would
    try:

        def write(w: int) -> None:
            for i in range(40):
                assert writers[w].put(f"kv/{w}/{i}", value(w * 100 + i), slot=w)

        threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        files = [p for p in (tmp_path / "chunks").rglob("*") if p.is_file()]
        held = sum(p.stat().st_size for p in files)
        assert held <= size
        assert writers[0].directory.usage() == held
        evicted = sum(w.directory.evicted_files for w in writers)
        assert evicted == 80 - len(files)  # every file written is held or was evicted once
        assert len(files) >= int(size * 0.9) // FILE - 1  # no eviction beyond the low water
        written = {writers[0].directory.path(f"kv/{w}/{i}"): (w, i) for w in range(2) for i in range(40)}
        for path in files:  # every file left is whole: either writer's values read back
            w, i = written[path]
            assert writers[0].get(f"kv/{w}/{i}") == value(w * 100 + i)
    finally:
        for writer in writers:
            writer.close()


def test_a_index_lookup_counts_leading_chunks_with_every_shard(tier: Tier) -> None:
    for i, key in enumerate(("kv/a/0", "kv/a/1", "kv/b/0")):
        assert tier.put(key, value(i))
    index = DiskChunkIndex(tier.directory)
    keys = [[ChunkKey("kv/a/0"), ChunkKey("kv/a/1")], [ChunkKey("kv/b/0"), ChunkKey("kv/b/1")]]
    assert index.lookup(keys) == 1
    assert index.poll_lookup(index.submit_lookup(keys[::-1])) == 0


WRITER = """
import sys
from pathlib import Path
from kvcore.ids import ChunkKey
from kvcore.ports import StoreItem, TierUsage
from kvcore_disk.directory import ChunkDirectory
from kvcore_disk.store import DiskChunkStore

root, size, value = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
directory = ChunkDirectory.open(root, size)
host = bytearray(value)
store = DiskChunkStore(directory, memoryview(host))
print("ready", flush=True)
for i in range(10**6):
    host[:8] = i.to_bytes(8, "little")
    host[-8:] = i.to_bytes(8, "little")
    (result,) = store.wait([store.submit_put([StoreItem(ChunkKey(f"kv/{i}"), 0, value)])], 10)
    print(i, result.ok, flush=True)
"""


def test_a_writer_killed_mid_save_leaves_only_whole_chunks(tmp_path: Path) -> None:
    big = 4 * 2**20  # a write long enough to be caught in the middle now and then
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), str(64 * big), str(big)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "ready"
    done = 0
    while done < 20:
        line = writer.stdout.readline().split()
        assert line[1] == "True"
        done = int(line[0]) + 1
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)
    writer.stdout.close()
    t = Tier(tmp_path, size=64 * big)  # a restart: the scan removes the dead writer's temporary
    try:
        temporaries = list((tmp_path / "chunks").rglob(".*"))
        assert temporaries == []
        host = bytearray(big)
        store = DiskChunkStore(t.directory, memoryview(host))
        served = 0
        for i in range(done + 2):
            job = store.submit_get([StoreItem(ChunkKey(f"kv/{i}"), 0, big)])
            (result,) = store.wait([job], TIMEOUT_S)
            if result.ok:
                assert host[:8] == host[-8:] == i.to_bytes(8, "little")
                served += 1
        assert served >= done  # every save reported done survived the kill
        store.close()
    finally:
        t.close()


FULL_DISK = """
import json, logging, os, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING)
from kvcore.errors import ConfigError
from kvcore.ids import ChunkKey
from kvcore.ports import StoreItem, TierUsage
from kvcore_disk.directory import ChunkDirectory
from kvcore_disk.store import DiskChunkStore

root = Path(sys.argv[1])
try:
    ChunkDirectory.open(root, 2**30)
except ConfigError as exc:
    print("size refused:", exc.field)
directory = ChunkDirectory.open(root, 140 * 1024)
host = bytearray(64 * 1024)
store = DiskChunkStore(directory, memoryview(host))
results = []
for i in range(8):
    host[:] = bytes([i]) * len(host)
    (r,) = store.wait([store.submit_put([StoreItem(ChunkKey(f"kv/{i}"), 0, len(host))])], 10)
    results.append(r.ok)
print("puts:", json.dumps(results))
temporaries = [p for p in (root / "chunks").rglob(".*")]
print("temporaries:", len(temporaries))
ok = []
for i in range(8):
    (r,) = store.wait([store.submit_get([StoreItem(ChunkKey(f"kv/{i}"), 0, len(host))])], 10)
    ok.append(r.ok and host == bytes([i]) * len(host))
print("gets:", json.dumps(ok))
store.close()
filler = os.open(root / "filler", os.O_WRONLY | os.O_CREAT)  # another program takes what is left
try:
    while os.write(filler, bytes(4096)):
        pass
except OSError:
    pass
os.close(filler)
directory = ChunkDirectory.open(root, 140 * 1024)  # a restart on the full disk
store = DiskChunkStore(directory, memoryview(host))
again = []
for i in range(8):
    (r,) = store.wait([store.submit_get([StoreItem(ChunkKey(f"kv/{i}"), 0, len(host))])], 10)
    again.append(r.ok and host == bytes([i]) * len(host))
print("gets after a restart on a full disk:", json.dumps(again))
store.close()
"""


def test_a_full_disk_drops_saves_with_one_warning_and_a_restart_on_it_serves_what_was_saved(
    tmp_path: Path,
) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs in a namespace of its own")
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    shell = f"mount -t tmpfs -o size=160k tmpfs {mount} && exec {sys.executable} {script} {mount}"
    run = subprocess.run(
        ["unshare", "-rm", "sh", "-c", shell],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    if run.returncode != 0 and "mount" in run.stderr and "puts:" not in run.stdout:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert lines["size refused"] == "backend.size"
    puts = json.loads(lines["puts"])
    assert puts[:2] == [True, True]
    assert False in puts  # the third 68 KiB file does not fit in 160 KiB
    assert lines["temporaries"] == "0"
    assert json.loads(lines["gets"]) == puts  # what was saved reads back whole; what was dropped is a miss
    assert run.stderr.count("No space left on device") == 1  # 6 saves dropped, one warning
    assert json.loads(lines["gets after a restart on a full disk"]) == puts  # the chunks stay served
    assert "more than its file system can give now" in run.stderr


def test_without_its_digest_library_the_disk_tier_says_what_to_install(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["xxhash"] = None  # as if it were not installed
        from kvcore.plugins.compose import open_scheduler
        from kvcore.config import load_config
        from kvcore.errors import ConfigError
        from tests.hand_engine import engine_spec
        config = load_config({{"backend": {{"kind": "disk", "path": {str(tmp_path)!r}, "size": "1GiB"}}}})
        try:
            open_scheduler(config, engine_spec(1))
        except ConfigError as exc:
            print(exc.field, "|", exc.expected)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("backend.kind | the disk tier's dependencies installed")
    assert "pip install 'kvcore[disk]'" in run.stdout
