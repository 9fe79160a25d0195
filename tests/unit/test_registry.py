"""The backend registry: installed kinds come from entry points, a config's ``backend`` is structured by
the kind's own class, and unknown, broken or ill-formed plugins are refused by name."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from attrs import field, frozen

from kvcore.config import KVCoreConfig, config_to_dict, load_config
from kvcore.errors import ConfigError, UsageError
from kvcore.execution.remote import StoreRemote
from kvcore.kit.settings import ByteSize, fits_in_memory, within
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.plugins.compose import open_scheduler, open_worker
from kvcore.plugins.registry import (
    backend,
    backends,
    engine_memory,
    register_backend,
    unregister_backend,
)
from kvcore.ports import BlockMover, BlockTransfer, ChunkIndex, Direction, RankMemory, RemoteTier
from kvcore.testing.faults import InjectedFaults
from kvcore.testing.memory import InMemoryChunkIndex
from kvcore_cpu.tier import CPUWorker
from kvcore_dirstore.store import DirChunkStore

IN_TREE = {"cpu", "mooncake_store", "lmcache_mp", "disk"}


@frozen
class EchoConfig:
    KIND: ClassVar[str] = "echo"
    HOST_FIELD: ClassVar[str] = "pool"
    MOVES_BLOCKS: ClassVar[bool] = False
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ("pool",)
    REMOTE: ClassVar[bool] = True
    pool: ByteSize = field(validator=fits_in_memory)
    replicas: int = field(default=1, validator=within(1, 8, "a count from 1 to 8"))

    @property
    def host_bytes(self) -> int:
        return self.pool


class EchoBackend:
    """A third-party backend: an in-memory index and the example's file store stand for its tier."""

    kind = "echo"
    config_class = EchoConfig

    def __init__(self, root: Path) -> None:
        self.root = root
        self.index = InMemoryChunkIndex(64)
        self.opened: list[RankMemory] = []

    def open_index(self, config: KVCoreConfig, engine: EngineSpec) -> ChunkIndex | None:
        return self.index

    def open_remote(self, config: KVCoreConfig, engine: EngineSpec, memory: RankMemory) -> RemoteTier | None:
        assert memory.host is not None
        self.opened.append(memory)
        return StoreRemote(DirChunkStore(self.root, memory.host))


@pytest.fixture
def echo(tmp_path: Path) -> Iterator[EchoBackend]:
    plugin = EchoBackend(tmp_path)
    register_backend(plugin)
    try:
        yield plugin
    finally:
        unregister_backend("echo")


def _engine() -> EngineSpec:
    layout = KVLayout(
        LayoutKind.VLLM_CPU, num_blocks=32, block_tokens=16, num_kv_heads=2, head_size=16, dtype_size=2
    )
    return EngineSpec("tiny@main", "bfloat16", num_layers=2, total_kv_heads=2, layout=layout)


def test_the_in_tree_backends_register_through_entry_points() -> None:
    installed = backends()
    assert set(installed) >= IN_TREE
    for kind in IN_TREE:
        assert installed[kind].kind == kind == installed[kind].config_class.KIND


@pytest.mark.parametrize("kind", ["nope", "", 3, None, "CPU"])
def test_an_unknown_kind_names_the_field_and_lists_the_installed_kinds(kind: object) -> None:
    with pytest.raises(ConfigError) as error:
        load_config({"backend": {"kind": kind}})
    assert error.value.field == "backend.kind"
    assert error.value.value == kind
    assert all(repr(k) in error.value.expected for k in IN_TREE)
    with pytest.raises(ConfigError, match=r"backend\.kind"):
        backend(kind)


def test_a_registered_backend_is_selectable_and_structured_by_its_own_class(echo: EchoBackend) -> None:
    config = load_config({"backend": {"kind": "echo", "pool": "1MiB", "replicas": 2}})
    assert config.backend == EchoConfig(ByteSize(1 << 20), replicas=2)
    assert config_to_dict(config)["backend"] == {"kind": "echo", "pool": 1 << 20, "replicas": 2}
    assert load_config(config_to_dict(config)) == config
    with pytest.raises(ConfigError) as error:
        load_config({"backend": {"kind": "echo", "pool": "1MiB", "replicas": 9}})
    assert (error.value.field, error.value.value) == ("backend.replicas", 9)
    with pytest.raises(ConfigError) as error:
        load_config({"backend": {"kind": "echo", "pool": "1MiB", "colour": "red"}})
    assert error.value.field == "backend.colour"
    with pytest.raises(ConfigError) as error:  # REMOTE: chunks come back without the local digests
        load_config({"backend": {"kind": "echo", "pool": "1MiB"}, "checksums": True})
    assert error.value.field == "checksums"


def test_compose_opens_a_registered_backend_on_both_sides(echo: EchoBackend) -> None:
    engine = _engine()
    config = load_config({"backend": {"kind": "echo", "pool": "1MiB"}, "chunk_tokens": 16})
    scheduler = open_scheduler(config, engine)
    assert scheduler.stats().pool.capacity > 0
    kv = [torch.zeros(engine.layout.shape, dtype=torch.bfloat16) for _ in range(engine.num_layers)]
    worker = open_worker(config, engine, kv)
    try:
        (memory,) = echo.opened
        assert memory.rank == 0
        assert memory.host is not None
        slot = engine.blocks_per_chunk(16) * engine.host_block_bytes
        assert memory.host.nbytes == scheduler.stats().pool.capacity * slot
        assert memory.host_address
    finally:
        worker.close()


def _first_pair_failed(mover: BlockMover) -> bool:
    job = mover.submit(BlockTransfer(Direction.SAVE, [0, 1], [0, 1]))
    (result,) = mover.wait([job], 10)
    return result.failed == (0,)


def test_compose_hands_faults_to_every_mover_of_the_rank(echo: EchoBackend) -> None:
    engine = _engine()
    faults = InjectedFaults()
    kv = [torch.zeros(engine.layout.shape, dtype=torch.bfloat16) for _ in range(engine.num_layers)]
    cpu = load_config({"backend": {"kind": "cpu", "size": "1MiB"}, "chunk_tokens": 16})
    worker = open_worker(cpu, engine, kv, faults=faults)
    try:
        assert isinstance(worker, CPUWorker)
        assert worker.mover is not None
        faults.fail_next(1)
        assert _first_pair_failed(worker.mover)
        assert worker.mover.wait([worker.mover.submit(BlockTransfer(Direction.SAVE, [0], [0]))], 10)[0].ok
    finally:
        worker.close()
    remote = load_config({"backend": {"kind": "echo", "pool": "1MiB"}, "chunk_tokens": 16})
    worker = open_worker(remote, engine, kv, faults=faults)
    try:
        (memory,) = echo.opened
        pool = mmap.mmap(-1, 2 * engine.host_block_bytes)
        mapped = memory.movers.over(pool)  # what a tier that maps its own memory copies through
        try:
            faults.fail_next(1)
            assert _first_pair_failed(mapped)
        finally:
            mapped.close()
    finally:
        worker.close()


def test_a_backend_whose_kind_is_not_its_config_kind_is_refused() -> None:
    class Liar(EchoBackend):
        kind = "liar"

    with pytest.raises(UsageError, match="'liar'"):
        register_backend(Liar(Path()))
    assert "liar" not in backends()


def test_a_kind_held_by_another_backend_is_refused(echo: EchoBackend) -> None:
    with pytest.raises(UsageError, match="registered already"):
        register_backend(EchoBackend(echo.root))
    assert backends()["echo"] is echo


def test_tensors_no_engine_memory_accepts_are_refused_by_name() -> None:
    assert engine_memory([torch.zeros(1)]).name == "torch"
    with pytest.raises(UsageError, match="tensors"):
        engine_memory([bytearray(8)])
    engine = _engine()
    config = load_config({"backend": {"kind": "cpu", "size": "1MiB"}, "chunk_tokens": 16})
    with pytest.raises(ConfigError) as error:
        open_worker(config, engine, [], rank=1)
    assert (error.value.field, error.value.value) == ("rank", 1)


def _python(code: str, path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_broken_plugin_is_left_out_and_named_and_the_others_still_load(tmp_path: Path) -> None:
    info = tmp_path / "kvcore_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcore-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvcore.backends]\nbroken = kvcore_no_such_module:BACKEND\n")
    run = _python(
        """
        from kvcore import ConfigError, load_config
        assert load_config({"backend": {"kind": "cpu", "size": "1MiB"}}).backend.KIND == "cpu"
        try:
            load_config({"backend": {"kind": "broken"}})
        except ConfigError as error:
            print(error)
        """,
        tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert "backend.kind: got 'broken'" in run.stdout
    assert "left out as broken: 'broken' (kvcore_no_such_module:BACKEND: ModuleNotFoundError" in run.stdout
    assert "plugin 'broken' is left out" in run.stderr  # the warning, logged once at load


def test_reading_a_config_imports_no_backend_dependency(tmp_path: Path) -> None:
    run = _python(
        """
        import sys
        from kvcore import load_config
        for backend in (
            {"kind": "cpu", "size": "1MiB"},
            {"kind": "mooncake_store"},
            {"kind": "lmcache_mp"},
            {"kind": "disk", "path": "/nowhere", "size": "1GiB"},
        ):
            load_config({"backend": backend})
        heavy = sorted(m for m in ("torch", "zmq", "mooncake", "lmcache", "numpy") if m in sys.modules)
        print(heavy)
        """,
        tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
