"""Config: strict parsing, sizes, and errors that name the field, the value and what was expected."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvcore.config import PDConfig, config_to_dict, load_config, load_config_file, load_pd_config, parse_size
from kvcore.errors import ConfigError
from kvcore.keying.hashing import HashAlgorithm, PartialChunkPolicy
from kvcore_cpu.config import CPUBackendConfig
from kvcore_lmcache.config import LMCacheMPConfig
from kvcore_mooncake.config import MooncakeStoreConfig


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("8GiB", 8 << 30),
        ("512MB", 512_000_000),
        ("1.5 GiB", 3 << 29),
        ("64KiB", 64 << 10),
        ("64kB", 64_000),
        ("2TB", 2 * 10**12),
    ],
)
def test_sizes_parse(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "meant"),
    [
        ("10gb", "'10GiB' or '10GB'"),
        ("8GIB", "'8GiB' or '8GB'"),
        ("64kib", "'64KiB' or '64KB'"),
        ("4G", "'4GiB' or '4GB'"),
        ("4Gi", "'4GiB' or '4GB'"),
        ("1.5 tb", "'1.5TiB' or '1.5TB'"),
    ],
)
def test_a_unit_spelt_otherwise_is_refused_with_both_readings(text: str, meant: str) -> None:
    """ "10gb" is refused, not read as 10 GB or 10 GiB (7 % apart): the error says which is which."""
    with pytest.raises(ConfigError) as info:
        parse_size(text, "backend.size")
    assert info.value.field == "backend.size"
    assert "spelled exactly" in str(info.value)
    assert f"did you mean {meant}?" in str(info.value)


@pytest.mark.parametrize("bad", [0, -1, "0GiB", "8 parsecs", "GiB", True, 3.5, None, "-4MB"])
def test_bad_sizes_name_the_field(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(bad, "backend.size")
    assert info.value.field == "backend.size"
    assert info.value.value == bad


def test_defaults_and_values() -> None:
    config = load_config(
        {"backend": {"kind": "cpu", "size": "2GiB"}, "hash_algorithm": "blake2b", "partial_chunks": "keep"}
    )
    assert config.backend == CPUBackendConfig(size=2 << 30)  # type: ignore[arg-type]  # ByteSize is an int
    assert config.hash_algorithm is HashAlgorithm.BLAKE2B
    assert config.partial_chunks is PartialChunkPolicy.KEEP
    assert config.chunk_tokens == 256
    assert config.eviction == "lru"


@pytest.mark.parametrize(
    ("data", "field", "value"),
    [
        ({"backend": {"kind": "cpu", "size": "2GiB"}, "chunk_tokens": 3.7}, "chunk_tokens", 3.7),
        ({"backend": {"kind": "cpu", "size": "2GiB"}, "chunk_tokens": 0}, "chunk_tokens", 0),
        ({"backend": {"kind": "cpu", "size": "2GiB"}, "chunk_tokens": True}, "chunk_tokens", True),
        ({"backend": {"kind": "cpu", "size": "lots"}}, "backend.size", "lots"),
        ({"backend": {"kind": "cpu", "size": -5}}, "backend.size", -5),
        ({"backend": {"kind": "floppy", "size": 1}}, "backend.kind", "floppy"),
        ({"backend": {"size": 1}}, "backend.kind", "<missing>"),
        ({"backend": {"kind": "cpu", "size": 1}, "eviction": "mru"}, "eviction", "mru"),
        ({"backend": {"kind": "cpu", "size": 1}, "hash_algorithm": "md5"}, "hash_algorithm", "md5"),
        ({"backend": {"kind": "cpu", "size": 1}, "checksums": "yes"}, "checksums", "yes"),
        ({"backend": {"kind": "lmcache_mp"}, "checksums": True}, "checksums", True),  # no pool to check
        ({"backend": {"kind": "cpu", "size": 1}, "lookup_timeout_s": -1}, "lookup_timeout_s", -1),
        ({"chunk_tokens": 256}, "backend", "<missing>"),
        ({"backend": {"kind": "cpu", "size": 1}, "chunk_tokenz": 256}, "chunk_tokenz", "<unknown key>"),
        ({"backend": {"kind": "cpu", "size": 1, "sise": 2}}, "backend.sise", "<unknown key>"),
    ],
)
def test_bad_values_name_field_and_value(data: dict[str, object], field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert info.value.field == field
    assert info.value.value == value
    assert field in str(info.value)


def test_every_problem_is_listed() -> None:
    # two values of the wrong type -> the first raises, the second is in a note
    with pytest.raises(ConfigError) as info:
        load_config({"backend": {"kind": "cpu", "size": 1}, "chunk_tokens": "x", "eviction": 5})
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "eviction" in str(info.value) + notes
    assert "chunk_tokens" in str(info.value) + notes


def test_secret_never_printed() -> None:
    config = load_config({"backend": {"kind": "cpu", "size": 1}, "secret": "hunter2"})
    assert "hunter2" not in repr(config)
    assert config_to_dict(config)["secret"] == "***"


def test_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "kvcore.json"
    path.write_text(json.dumps({"backend": {"kind": "cpu", "size": "1GiB"}, "eviction": "arc"}))
    config = load_config_file(path)
    assert config.eviction == "arc"
    assert load_config(config_to_dict(config)) == config


def test_unreadable_or_invalid_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config_file"):
        load_config_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="valid JSON"):
        load_config_file(bad)
    with pytest.raises(ConfigError, match="config_file"):
        load_config_file(tmp_path / "nul\x00in-the-name.json")


def test_the_pd_section_loads_alone() -> None:
    assert load_pd_config({"pd": {"port": 5600}}).port == 5600
    assert load_pd_config({"other": 1}) == PDConfig()  # no section: the defaults; other keys are not its own
    with pytest.raises(ConfigError, match=r"pd\.port"):
        load_pd_config({"pd": {"port": -1}})
    with pytest.raises(ConfigError, match=r"pd\.bogus"):
        load_pd_config({"pd": {"bogus": 1}})
    with pytest.raises(ConfigError, match="pd"):
        load_pd_config({"pd": 3})


# -- hostile input: every problem is a ConfigError naming the field ------------------------------------

PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def nested(levels: int) -> object:
    """A list in a list ... ``levels`` deep: ``repr`` of it recurses past Python's limit."""
    value: object = []
    for _ in range(levels):
        value = [value]
    return value


def _config_with(path: str, value: object, kind: str = "cpu", **backend: object) -> dict[str, Any]:
    """A valid config with ``backend.kind`` = ``kind`` and ``value`` at the dotted ``path``."""
    data: dict[str, Any] = {"backend": {"kind": kind, **({"size": 1} if kind == "cpu" else {}), **backend}}
    section, _, name = path.rpartition(".")
    target = data if not section else data.setdefault(section, {})
    target[name] = value
    return data


def _refused(data: object, field: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(data)  # type: ignore[arg-type]  # hostile input on purpose
    assert info.value.field == field, str(info.value)
    message = str(info.value)
    assert field in message
    assert "<invalid>" not in message  # never the catch-all: each problem has its own words
    assert len(message) < 500
    return info.value


SECONDS = [
    ("cpu", "lookup_timeout_s"),
    ("cpu", "transfer_timeout_s"),
    ("mooncake_store", "backend.setup_timeout_s"),
    ("lmcache_mp", "backend.request_timeout_s"),
    ("lmcache_mp", "backend.heartbeat_s"),
    ("lmcache_mp", "backend.connect_timeout_s"),
    ("cpu", "pd.handshake_timeout_s"),
    ("cpu", "pd.abort_timeout_s"),
]


@pytest.mark.parametrize(("kind", "path"), SECONDS)
@pytest.mark.parametrize(
    "bad",
    [
        math.nan,
        math.inf,
        -math.inf,
        pytest.param(10**400, id="10**400"),
        1e300,
        86_400.5,
        10**6,
        0,
        0.0,
        -1,
        1e-300,
        0.0009,
    ],
)
def test_timeouts_are_finite_and_bounded(kind: str, path: str, bad: object) -> None:
    _refused(_config_with(path, bad, kind), path)


@pytest.mark.parametrize(("kind", "path"), SECONDS)
def test_timeouts_accept_a_millisecond_to_a_day(kind: str, path: str) -> None:
    for good in (0.001, 1, 86_400):
        load_config(_config_with(path, good, kind))


@pytest.mark.parametrize(
    ("kind", "path", "bad"),
    [
        ("cpu", "epoch", ""),
        ("cpu", "secret", ""),
        ("cpu", "hash_seed", ""),
        ("cpu", "epoch", "\ud800"),  # a lone surrogate (JSON can spell one): no UTF-8 encoding exists
        ("cpu", "secret", "\udcff"),
        ("cpu", "hash_seed", "a\ud800b"),
        ("mooncake_store", "backend.master", ""),
        ("mooncake_store", "backend.master", "no-port-here"),
        ("mooncake_store", "backend.master", ":50051"),
        ("mooncake_store", "backend.master", "host:0"),
        ("mooncake_store", "backend.master", "host:65536"),
        ("mooncake_store", "backend.master", "host:port"),
        ("mooncake_store", "backend.master", "host :50051"),
        ("mooncake_store", "backend.metadata", ""),
        ("mooncake_store", "backend.local_hostname", ""),
        ("mooncake_store", "backend.local_hostname", "bad host"),
        ("mooncake_store", "backend.devices", "mlx5_0\n"),
        ("lmcache_mp", "backend.url", ""),
        ("lmcache_mp", "backend.url", "localhost:5555"),
        ("lmcache_mp", "backend.url", "tcp://"),
        ("cpu", "pd.host", ""),
        ("cpu", "pd.host", "127.0.0.1\x00"),
        ("cpu", "pd.devices", "\ud800"),
    ],
)
def test_strings_that_cannot_work_are_refused(kind: str, path: str, bad: str) -> None:
    _refused(_config_with(path, bad, kind), path)


def test_strings_documented_as_optional_may_be_empty() -> None:
    mooncake = load_config(_config_with("backend.devices", "", "mooncake_store", master="[::1]:50051"))
    assert mooncake.backend == MooncakeStoreConfig(master="[::1]:50051", devices="")
    assert load_config(_config_with("pd.devices", "")).pd == PDConfig(devices="")
    assert load_config(_config_with("secret", None)).secret is None
    lmcache = load_config(_config_with("backend.url", "ipc:///tmp/lmcache", "lmcache_mp"))
    assert lmcache.backend == LMCacheMPConfig(url="ipc:///tmp/lmcache")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (str(2**53 + 1), 2**53 + 1),  # not rounded through a float
        ("9007199254740993B", 2**53 + 1),
        (2**63 - 1, 2**63 - 1),
        ("0.5KiB", 512),
        ("1.25 GB", 1_250_000_000),
        ("1.0B", 1),
    ],
)
def test_sizes_parse_exactly(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "1.5B",
        "0.3B",
        "1.0000000001GiB",
        2**63,
        str(2**63),
        "8EiB",
        "9" * 5000,
        pytest.param(10**5000, id="10**5000"),
        "\u0663MiB",
        "1e9",
        "8 GiB!",
    ],
)
def test_fractional_and_absurd_sizes_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(bad, "backend.size")
    assert info.value.field == "backend.size"
    assert len(str(info.value)) < 500


def _too_big(error: ConfigError, asked: int) -> None:
    assert error.value == asked
    assert str(PHYSICAL) in error.expected, error.expected  # what is available


@pytest.mark.skipif(PHYSICAL <= 0, reason="no physical memory size on this platform")
def test_host_sizes_beyond_this_machine_are_refused() -> None:
    error = _refused(_config_with("backend.size", PHYSICAL + 1), "backend.size")
    _too_big(error, PHYSICAL + 1)
    error = _refused(_config_with("backend.local_size", PHYSICAL + 1, "lmcache_mp"), "backend.local_size")
    _too_big(error, PHYSICAL + 1)
    for name in ("local_size", "segment_size", "transfer_buffer_size"):
        path = f"backend.{name}"
        error = _refused(_config_with(path, PHYSICAL, "mooncake_store"), path)  # the other two push it over
        _too_big(error, PHYSICAL)
    # one node holds a Mooncake client's local tier, its segment and its transfer buffer: their sum counts,
    # and the largest of the three is named
    half = PHYSICAL // 2
    both = _config_with("backend.local_size", half, "mooncake_store", segment_size=half + (64 << 20))
    _too_big(_refused(both, "backend.segment_size"), half + (64 << 20))
    assert load_config(_config_with("backend.size", PHYSICAL)).backend.host_bytes == PHYSICAL


@pytest.mark.parametrize("bad", [-1, 65_536, 10**30, True, "80", 80.0, None, [80], {"port": 80}])
def test_pd_port_is_0_to_65535(bad: object) -> None:
    _refused(_config_with("pd.port", bad), "pd.port")
    with pytest.raises(ConfigError, match=r"pd\.port"):
        load_pd_config({"pd": {"port": bad}})


def test_pd_port_0_picks_one_and_65535_is_a_port() -> None:
    assert load_config(_config_with("pd.port", 0)).pd == PDConfig(port=0)
    assert load_config(_config_with("pd.port", 65_535)).pd == PDConfig(port=65_535)


@pytest.mark.parametrize("bad", ["x", "9" * 400, 3, True, [1, 2], ["port"], 1.5])
def test_a_pd_section_that_is_not_a_mapping_names_pd(bad: object) -> None:
    _refused({"backend": {"kind": "cpu", "size": 1}, "pd": bad}, "pd")
    with pytest.raises(ConfigError) as info:
        load_pd_config({"pd": bad})
    assert info.value.field == "pd"
    assert "attribute" not in str(info.value)
    assert len(str(info.value)) < 300


@pytest.mark.parametrize(
    ("backend", "field"),
    [
        ([{"kind": "cpu", "size": 1}], "backend"),
        ("cpu", "backend"),
        (3, "backend"),
        (None, "backend"),
        (True, "backend"),
        ({}, "backend.kind"),
        ({"kind": 3, "size": 1}, "backend.kind"),
        ({"kind": ["cpu"], "size": 1}, "backend.kind"),
        ({"kind": {"cpu": 1}, "size": 1}, "backend.kind"),
        ({"kind": "CPU", "size": 1}, "backend.kind"),
        ({"kind": "cpu"}, "backend.size"),
        ({"kind": "cpu", "size": {"GiB": 1}}, "backend.size"),
        ({"kind": "cpu", "size": [1]}, "backend.size"),
        ({"kind": "cpu", "size": 1.0}, "backend.size"),
        ({"kind": "mooncake_store", "replicas": 0}, "backend.replicas"),
        ({"kind": "mooncake_store", "replicas": 10**30}, "backend.replicas"),
        ({"kind": "mooncake_store", "replicas": 1025}, "backend.replicas"),
        ({"kind": "mooncake_store", "replicas": True}, "backend.replicas"),
        ({"kind": "mooncake_store", "protocol": ["tcp"]}, "backend.protocol"),
        ({"kind": "mooncake_store", "master": {"host": "h"}}, "backend.master"),
        ({"kind": "mooncake_store", "segment_size": -1}, "backend.segment_size"),
        ({"kind": "lmcache_mp", "transfer_mode": None}, "backend.transfer_mode"),
        ({"kind": "lmcache_mp", "local_size": "-1B"}, "backend.local_size"),
    ],
)
def test_hostile_backends_name_the_field(backend: object, field: str) -> None:
    _refused({"backend": backend}, field)


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ("chunk_tokens", 10**30),
        ("chunk_tokens", 2**20 + 1),
        ("chunk_tokens", -256),
        ("chunk_tokens", {"a": 1}),
        ("chunk_tokens", nested(5_000)),
        pytest.param("chunk_tokens", 10**5000, id="10**5000"),  # its repr raises: more than 4300 digits
        ("save_after_sightings", 10**30),
        ("save_after_sightings", False),
        ("eviction", ["lru"]),
        ("eviction", {"lru": True}),
        ("hash_algorithm", ["sha256"]),
        ("hash_algorithm", {"a": 1}),
        ("hash_algorithm", nested(5_000)),  # Enum's own error would repr it
        pytest.param("hash_algorithm", 10**5000, id="enum-10**5000"),
        ("partial_chunks", None),
        ("checksums", 1),
        ("epoch", 0),
        ("secret", ["x"]),
        ("hash_seed", "s" * 100_000 + "\ud800"),
        ("pd.handshake_retries", -1),
        ("pd.handshake_retries", 10**30),
        ("pd.protocol", "udp"),
        ("pd.host", nested(5_000)),
    ],
)
def test_hostile_values_name_the_field(path: str, bad: object) -> None:
    _refused(_config_with(path, bad), path)


def test_chunk_tokens_up_to_a_million_or_so() -> None:
    assert load_config(_config_with("chunk_tokens", 2**20)).chunk_tokens == 2**20


def test_keys_of_any_type_are_named() -> None:
    error = _refused({"backend": {"kind": "cpu", "size": 1}, 1: 2, "x": 3, None: 4}, "1")
    notes = " ".join(getattr(error, "__notes__", []))
    assert "x" in notes
    assert "None" in notes


class _Broken(Mapping[str, object]):
    """A mapping that fails when read: what a misbehaving YAML loader or adapter might hand in."""

    def __getitem__(self, key: str) -> object:
        raise RuntimeError("broken mapping")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("broken mapping")

    def __len__(self) -> int:
        return 1


def test_a_mapping_that_fails_when_read_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"backend": _Broken()})
    assert info.value.field == "backend"
    with pytest.raises(ConfigError) as info:
        load_config(_Broken())
    assert info.value.field == "config"


@pytest.mark.parametrize(
    "backend",
    [
        {"kind": "mooncake_store"},
        {"kind": "lmcache_mp", "local_size": "64MiB"},
        {"kind": "lmcache_mp"},
    ],
)
def test_checksums_need_the_cpu_tier(backend: dict[str, object]) -> None:
    error = _refused({"backend": backend, "checksums": True}, "checksums")
    assert "local CPU tier" in error.expected
    assert load_config({"backend": backend, "checksums": False}).checksums is False
    assert load_config({"backend": {"kind": "cpu", "size": 1}, "checksums": True}).checksums


def test_direct_construction_checks_too() -> None:
    with pytest.raises(ConfigError, match="replicas"):
        MooncakeStoreConfig(replicas=0)
    with pytest.raises(ConfigError, match="port"):
        PDConfig(port=70_000)
    with pytest.raises(ConfigError, match="abort_timeout_s"):
        PDConfig(abort_timeout_s=math.inf)


@pytest.mark.parametrize(
    ("data", "field", "meant"),
    [
        ({"backend": {"kind": "cpu", "size": 1}, "chunk_token": 256}, "chunk_token", "chunk_tokens"),
        ({"backend": {"kind": "cpu", "size": 1}, "evicton": "lru"}, "evicton", "eviction"),
        ({"backend": {"kind": "cpu", "sizes": 1}}, "backend.size", "size"),
        ({"backend": {"kind": "mooncake", "master": "h:1"}}, "backend.kind", "mooncake_store"),
        ({"backend": {"kind": "cpu", "size": 1}, "tier": []}, "tier", "tiers"),
        ({"tiers": [{"kind": "cpu", "size": 1}, {"kind": "dsk", "path": "/x"}]}, "tiers[1].kind", "disk"),
    ],
)
def test_a_typo_is_told_the_key_or_kind_it_is_closest_to(
    data: dict[str, Any], field: str, meant: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert info.value.field == field
    assert f"did you mean {meant!r}?" in str(info.value) + " ".join(getattr(info.value, "__notes__", ()))


def test_a_key_far_from_every_known_one_is_told_nothing_more() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"backend": {"kind": "cpu", "size": 1}, "zzzz": 1})
    assert "did you mean" not in str(info.value)


def test_an_engine_adapters_own_keys_are_candidates_too() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"backend": {"kind": "cpu", "size": 1}, "store_polcy": "lazy"}, beside=["store_policy"])
    assert "did you mean 'store_policy'?" in str(info.value)
