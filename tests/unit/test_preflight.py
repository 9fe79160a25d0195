"""The pre-flight (``kvcore.plugins.preflight``): a config read as the engine reads it, each tier's own
checks, the host memory beside the engine's, the pool's slots; and the one-line description of what runs
(``kvcore.config.describe``), the sizes it prints and the server probe the backends use."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from typing import ClassVar

import pytest
from attrs import field, frozen

from kvcore.config import KVCoreConfig, load_config
from kvcore.config.describe import describe
from kvcore.errors import ConfigError
from kvcore.kit.probe import probe_tcp
from kvcore.kit.settings import ByteSize, format_size
from kvcore.model.engine import EngineSpec
from kvcore.plugins import settings_of
from kvcore.plugins.preflight import (
    Finding,
    HostMemory,
    PreflightContext,
    SupportsPreflight,
    Verdict,
    preflight,
)
from kvcore.plugins.registry import register_backend, unregister_backend
from kvcore.ports import ChunkIndex, RankMemory

GiB = 2**30
ROOMY = HostMemory(total=64 * GiB, available=48 * GiB)


def machine(memory: HostMemory | None = ROOMY) -> HostMemory | None:
    return memory


@frozen
class ProbeConfig:
    KIND: ClassVar[str] = "probed"
    HOST_FIELD: ClassVar[str] = "local_size"
    MOVES_BLOCKS: ClassVar[bool] = False
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ("local_size", "buffer")
    REMOTE: ClassVar[bool] = True
    where: str = field(default="here")
    local_size: ByteSize = field(default=ByteSize(GiB))
    buffer: ByteSize = field(default=ByteSize(GiB))

    @property
    def host_bytes(self) -> int:
        return self.local_size


class ProbedBackend:
    """A remote tier whose pre-flight refuses ``where == "nowhere"``, warns of ``"slow"`` and raises
    for ``"bug"``: stands for a backend's own checks."""

    kind = "probed"
    config_class = ProbeConfig

    def __init__(self) -> None:
        self.contexts: list[PreflightContext] = []

    def preflight(self, config: KVCoreConfig, context: PreflightContext) -> Iterable[Finding]:
        settings = settings_of(config, ProbeConfig)
        self.contexts.append(context)
        if settings.where == "bug":
            raise RuntimeError("a bug in the plugin")
        if settings.where == "nowhere":
            yield Finding(
                "server", f"{context.field}.where", Verdict.REFUSED, "a server that answers", "nowhere"
            )
        elif settings.where == "slow":
            yield Finding("server", f"{context.field}.where", Verdict.WARNING, "no answer within 2 s")

    def open_index(self, config: KVCoreConfig, engine: EngineSpec) -> ChunkIndex | None:
        raise AssertionError("a pre-flight opens nothing")

    def open_remote(self, config: KVCoreConfig, engine: EngineSpec, memory: RankMemory) -> None:
        raise AssertionError("a pre-flight opens nothing")


@pytest.fixture
def probed() -> Iterator[ProbedBackend]:
    plugin = ProbedBackend()
    register_backend(plugin)
    try:
        yield plugin
    finally:
        unregister_backend("probed")


def test_a_config_the_engine_refuses_is_refused_with_the_engines_error() -> None:
    data = {"backend": {"kind": "cpu", "size": "1GiB"}, "chunk_token": 256}
    report = preflight(data, memory=machine)
    (refusal,) = report.refusals
    with pytest.raises(ConfigError) as engine:
        load_config(data)
    assert (refusal.field, refusal.value, refusal.text) == (
        engine.value.field,
        "<unknown key>",
        engine.value.expected,
    )
    assert report.config is None
    with pytest.raises(ConfigError, match="did you mean 'chunk_tokens'"):
        report.raise_refusal()


def test_each_tier_is_checked_by_its_backend_under_its_own_field(probed: ProbedBackend) -> None:
    data = {"tiers": [{"kind": "cpu", "size": "1GiB"}, {"kind": "probed", "where": "nowhere"}]}
    report = preflight(data, memory=machine, timeout_s=0.5, deep=True)
    assert [(f.field, f.verdict) for f in report.refusals] == [("tiers[1].where", Verdict.REFUSED)]
    assert probed.contexts == [PreflightContext("tiers[1]", 0.5, True)]
    with pytest.raises(ConfigError) as info:
        report.raise_refusal()
    assert (info.value.field, info.value.value) == ("tiers[1].where", "nowhere")


def test_a_warning_lets_the_engine_start_and_a_broken_plugin_is_one(probed: ProbedBackend) -> None:
    slow = preflight({"backend": {"kind": "probed", "where": "slow"}}, memory=machine)
    assert [f.field for f in slow.warnings] == ["backend.where"]
    assert not slow.refusals
    slow.raise_refusal()  # nothing to raise
    bug = preflight({"backend": {"kind": "probed", "where": "bug"}}, memory=machine)
    assert [f.text for f in bug.warnings] == [
        "the probed backend's pre-flight failed (RuntimeError: a bug in the plugin)"
    ]
    assert isinstance(probed, SupportsPreflight)


def test_the_tiers_host_memory_must_fit_beside_the_engines_own() -> None:
    data = {"backend": {"kind": "cpu", "size": "20GiB"}}
    assert not preflight(data, memory=machine).refusals
    tight = HostMemory(total=64 * GiB, available=30 * GiB)
    report = preflight(
        data, engine_host_bytes=16 * GiB, engine_reserve="the engine's cache", memory=lambda: tight
    )
    (refusal,) = report.refusals
    assert (refusal.check, refusal.field, refusal.value) == ("memory", "backend.size", 20 * GiB)
    assert "the tiers ask 20 GiB beside the engine's cache" in refusal.text
    assert "30 GiB available" in refusal.text
    assert not preflight(data, memory=None).findings[1:]  # memory not checked: nothing about it


def test_a_stacked_tier_counts_what_it_holds_beside_a_pool_of_its_own(probed: ProbedBackend) -> None:
    # the first tier's pool and the probed tier's buffer; not its local_size: it stages through tiers[0]
    tier = {"kind": "probed", "local_size": "40GiB", "buffer": "30GiB"}
    data = {"tiers": [{"kind": "cpu", "size": "10GiB"}, tier]}
    report = preflight(data, memory=lambda: HostMemory(total=64 * GiB, available=45 * GiB))
    assert not report.refusals
    assert "40 GiB of host memory for the tiers" in next(
        f.text for f in report.findings if f.check == "memory"
    )
    data["tiers"][1] = {**tier, "buffer": "40GiB"}
    (refusal,) = preflight(data, memory=lambda: HostMemory(total=64 * GiB, available=45 * GiB)).refusals
    assert (refusal.field, refusal.value) == ("tiers[1].buffer", 40 * GiB)


def test_a_pool_below_one_slot_per_rank_is_refused_when_the_model_is_known() -> None:
    data = {"backend": {"kind": "cpu", "size": 8}}
    (warning,) = preflight(data, memory=machine).warnings  # no model: a pool too small for any model
    assert "did you mean '8GiB'?" in warning.text
    report = preflight(
        {"backend": {"kind": "cpu", "size": "1MiB"}}, slot_floor=2**19, world_size=4, memory=machine
    )
    (refusal,) = report.refusals
    assert (refusal.field, refusal.value) == ("backend.size", 2**20)
    assert (
        "at least 2097152 bytes (2 MiB): one chunk of 256 tokens (at least 512 KiB) on each of 4 rank(s)"
        in refusal.text
    )
    fits = preflight(
        {"backend": {"kind": "cpu", "size": "4MiB"}}, slot_floor=2**19, world_size=4, memory=machine
    )
    assert [f.text for f in fits.findings if f.check == "memory"][
        -1
    ] == "at most 2 chunks of 256 tokens per rank"


def test_a_tier_that_moves_blocks_itself_needs_no_pool() -> None:
    report = preflight(
        {"backend": {"kind": "lmcache_mp", "url": "tcp://127.0.0.1:9"}}, slot_floor=2**20, memory=machine
    )
    assert not report.refusals
    assert [f.field for f in report.warnings] == ["backend.url"]  # nothing listens on port 9


def test_what_runs_is_one_line_with_sizes_as_given_and_as_resolved(tmp_path: object) -> None:
    data = {
        "tiers": [
            {"kind": "cpu", "size": "10GB"},
            {"kind": "disk", "path": "/nvme/kv", "size": "1TiB", "admit_after": 2, "write": "back"},
        ],
        "chunk_tokens": 512,
    }
    line = describe(load_config(data), data)
    assert line == (
        "tiers: cpu (size 10GB = 9.31 GiB) -> disk /nvme/kv (size 1 TiB, a value per KV head (any TP size), "
        "written back, admitted after 2 "
        "saves); chunks of 512 tokens (partial chunks kept), eviction lru, epoch '0'"
    )
    assert describe(load_config(data)).startswith("tiers: cpu (size 9.31 GiB) -> disk /nvme/kv (size 1 TiB")
    unsplit = describe(load_config(data), heads_split=False)  # an engine whose heads are runs per token
    assert "disk /nvme/kv (size 1 TiB, a value per rank (heads not cut apart), written back" in unsplit
    assert "P/D" not in line
    with_pd = describe(load_config({**data, "pd": {"host": "10.0.0.6", "port": 5600}}))
    assert with_pd.endswith("epoch '0'; P/D beside the tiers over tcp, side channel 10.0.0.6:5600")
    assert describe(load_config({**data, "pd": {}})).endswith("side channel 127.0.0.1:a free port")


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 bytes"),
        (1, "1 byte"),
        (1023, "1023 bytes"),
        (1024, "1 KiB"),
        (10**10, "9.31 GiB"),
        (3 * 2**40, "3 TiB"),
    ],
)
def test_sizes_print_in_binary_units(size: int, text: str) -> None:
    assert format_size(size) == text


def test_the_probe_tells_a_listening_port_from_a_closed_one() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert probe_tcp("127.0.0.1", port, 1.0) is None
    assert probe_tcp("127.0.0.1", port, 1.0) == "connection refused"
    assert "does not resolve" in str(probe_tcp("no-such-host.invalid", 80, 1.0))
