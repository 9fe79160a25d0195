"""Config properties: whatever value lands in whatever field, loading gives a valid config that survives a
round trip through ``config_to_dict``, or a ``ConfigError`` naming that field -- never another exception."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.config import KVCoreConfig, PDConfig, config_to_dict, load_config, load_pd_config, parse_size
from kvcore.errors import ConfigError
from kvcore_cpu.config import CPUBackendConfig
from kvcore_lmcache.config import LMCacheMPConfig
from kvcore_mooncake.config import MooncakeStoreConfig
from tests.unit.test_config import nested

CPU = {"kind": "cpu", "size": "1GiB"}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**16), max_value=2**16),
    st.integers(min_value=-(2**600), max_value=2**600),  # beyond a float, a C integer and any size
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
JSON_LIKE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
SIZES = st.builds(
    "{}{}{}".format,
    st.integers(min_value=0, max_value=2**64) | st.sampled_from([1, 64, 512]),
    st.sampled_from(["", ".0", ".5", ".25", ".0000001"]),
    st.sampled_from([*UNITS, " GiB", "TiB", "parsecs"]),
)
NEAR_VALID = st.one_of(
    st.sampled_from(
        [
            "tcp",
            "rdma",
            "lru",
            "arc",
            "sha256",
            "blake2b",
            "drop",
            "keep",
            "engine_driven",
            "P2PHANDSHAKE",
            "127.0.0.1:50051",
            "[::1]:65535",
            "host:0",
            "tcp://localhost:5555",
            "ipc:///tmp/lmcache",
            "mlx5_0,mlx5_1",
            "",
            " ",
            "\ud800",
            "\x00",
        ]
    ),
    SIZES,
    st.floats(min_value=0, max_value=100_000),
    st.integers(min_value=-1, max_value=70_000),
    st.integers(min_value=2**20 - 1, max_value=2**20 + 1),
)


HOSTILE = st.sampled_from([10**5000, -(10**5000), nested(5_000), {"a": nested(5_000)}, "x" * 100_000])
"""Rare but fatal to a naive error message: ``repr`` raises on the integers and recurses on the nesting."""
VALUES = st.one_of(JSON_LIKE, NEAR_VALID, HOSTILE)

Loader = Callable[[Mapping[str, object]], object]


def _cases() -> list[Any]:
    """(dotted path, a valid mapping, loader) for every field of every config class (and ``backend.kind``);
    the value under test goes at the path."""
    cases: list[Any] = []
    for name in attrs.fields_dict(KVCoreConfig):
        cases.append(pytest.param(name, {"backend": CPU}, load_config, id=name))
    for cls in (CPUBackendConfig, MooncakeStoreConfig, LMCacheMPConfig):
        base = {"backend": CPU if cls is CPUBackendConfig else {"kind": cls.KIND}}
        for name in ("kind", *attrs.fields_dict(cls)):
            cases.append(pytest.param(f"backend.{name}", base, load_config, id=f"{cls.KIND}.{name}"))
    for name in attrs.fields_dict(PDConfig):
        path = f"pd.{name}"
        cases.append(pytest.param(path, {"backend": CPU, "pd": {}}, load_config, id=path))
        cases.append(pytest.param(path, {"pd": {}}, load_pd_config, id=f"alone.{path}"))
    return cases


def _put(base: Mapping[str, Any], path: str, value: object) -> dict[str, Any]:
    """A copy of ``base`` with ``value`` at the dotted ``path`` (the sections on the way copied too)."""
    head, _, rest = path.partition(".")
    data = dict(base)
    data[head] = _put(data[head], rest, value) if rest else value
    return data


def _outcome(load: Loader, data: Mapping[str, object]) -> object:
    try:
        return load(data)
    except ConfigError as error:
        return error


@pytest.mark.parametrize(("path", "base", "load"), _cases())
@settings(max_examples=25, deadline=None)
@given(value=VALUES)
def test_any_value_in_any_field_loads_or_names_that_field(
    path: str, base: Mapping[str, object], load: Loader, value: object
) -> None:
    data = _put(base, path, value)
    outcome = _outcome(load, data)
    if isinstance(outcome, ConfigError):
        nested = path in ("backend", "pd") and outcome.field.startswith(f"{path}.")
        assert outcome.field == path or nested, f"{outcome} (expected the field {path})"
        assert len(str(outcome)) < 1000
        assert "<unreadable>" not in str(outcome)  # the catch-all is for mappings that fail when read
    elif isinstance(outcome, PDConfig):  # the section alone loads as it does inside a whole config
        assert load_config({"backend": CPU, **data}).pd == outcome
    else:
        assert isinstance(outcome, KVCoreConfig)
        parts: list[attrs.AttrsInstance] = [outcome, outcome.backend, *([outcome.pd] if outcome.pd else [])]
        numbers = [v for part in parts for v in attrs.asdict(part, recurse=False).values()]
        assert all(math.isfinite(v) for v in numbers if isinstance(v, float))
        masked = attrs.evolve(outcome, secret=None if outcome.secret is None else "***")  # printed masked
        assert load_config(config_to_dict(outcome)) == masked


@settings(max_examples=100, deadline=None)
@given(
    whole=st.integers(min_value=0, max_value=2**70),
    fraction=st.sampled_from(["", ".5", ".25", ".125", ".1", ".001"]),
    unit=st.sampled_from(sorted(UNITS)),
)
def test_size_strings_parse_exactly(whole: int, fraction: str, unit: str) -> None:
    text = f"{whole}{fraction}{unit}"
    exact = Fraction(f"{whole}{fraction}") * UNITS[unit]
    if exact.denominator == 1 and 0 < exact < 2**63:
        assert parse_size(text) == exact
    else:
        with pytest.raises(ConfigError):
            parse_size(text)
