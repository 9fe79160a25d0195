"""Config: strict parsing, sizes, and errors that name the field, the value and what was expected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcore.config import (
    CPUBackendConfig,
    PDConfig,
    config_to_dict,
    load_config,
    load_config_file,
    load_pd_config,
    parse_size,
)
from kvcore.errors import ConfigError
from kvcore.hashing import HashAlgorithm, PartialChunkPolicy


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("8GiB", 8 << 30),
        ("512MB", 512_000_000),
        ("1.5 GiB", 3 << 29),
        ("64kib", 64 << 10),
    ],
)
def test_sizes_parse(text: object, expected: int) -> None:
    assert parse_size(text) == expected


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
        ({"backend": {"kind": "floppy", "size": 1}}, "backend", "floppy"),
        ({"backend": {"size": 1}}, "backend", None),
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


def test_the_pd_section_loads_alone() -> None:
    assert load_pd_config({"pd": {"port": 5600}}).port == 5600
    assert load_pd_config({"other": 1}) == PDConfig()  # no section: the defaults; other keys are not its own
    with pytest.raises(ConfigError, match=r"pd\.port"):
        load_pd_config({"pd": {"port": -1}})
    with pytest.raises(ConfigError, match=r"pd\.bogus"):
        load_pd_config({"pd": {"bogus": 1}})
    with pytest.raises(ConfigError, match="pd"):
        load_pd_config({"pd": 3})
