"""A stack of tiers in the config (``{"tiers": [...]}``, ``kvcore.config.tiers``): what is accepted, what each
mistake is told, and that a stack of the pool and one remote tier sizes the pool as ``backend`` does."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.config import config_to_dict, load_config
from kvcore.config.tiers import TierStack
from kvcore.errors import ConfigError
from kvcore.plugins.sizing import host_field

POOL = {"kind": "cpu", "size": "64MiB"}
DISK = {"kind": "disk", "path": "/var/kv", "size": "1GiB"}
STORE = {"kind": "mooncake_store", "master": "127.0.0.1:50051"}


def test_a_stack_holds_the_pool_and_its_remote_tiers_in_order() -> None:
    config = load_config(
        {"tiers": [POOL, {**DISK, "admit_after": 2, "write": "back"}, STORE], "chunk_tokens": 128}
    )
    stack = config.backend
    assert isinstance(stack, TierStack)
    assert stack.host_bytes == 64 * 2**20
    assert host_field(config) == "tiers[0].size"
    assert [t.settings.KIND for t in stack.remote] == ["disk", "mooncake_store"]
    assert [t.admit_after for t in stack.remote] == [2, 1]
    assert [t.write for t in stack.remote] == ["back", "through"]
    assert stack.writes_back
    assert load_config(config_to_dict(config)) == config  # what config check prints reads back the same


@pytest.mark.parametrize(
    ("tiers", "field", "expected"),
    [
        ([POOL], "tiers", "a list of at least two tiers"),
        ("cpu,disk", "tiers", "a list of at least two tiers"),
        ([DISK, STORE], "tiers[0].kind", "a local pool first"),
        ([POOL, POOL], "tiers[1].kind", "a remote tier"),
        ([POOL, {**DISK, "size": "lots"}], "tiers[1].size", "a positive whole number of bytes"),
        ([POOL, {**DISK, "admit_after": 0}], "tiers[1].admit_after", "a count of saves from 1"),
        ([POOL, {**DISK, "admit_after": "2"}], "tiers[1].admit_after", "an integer"),
        ([{**POOL, "admit_after": 2}, DISK], "tiers[0].admit_after", "no such key"),
        ([POOL, {**DISK, "write": "later"}], "tiers[1].write", "one of 'through', 'back'"),
        ([POOL, {**DISK, "write": True}], "tiers[1].write", "a string"),
        ([{**POOL, "write": "back"}, DISK], "tiers[0].write", "no such key"),
        (
            [POOL, {"kind": "lmcache_mp", "write": "back"}],
            "tiers[1].write",
            "'through' for kind 'lmcache_mp'",
        ),
        ([POOL, {**DISK, "colour": "red"}], "tiers[1].colour", "no such key"),
        ([POOL, {"kind": "tape"}], "tiers[1].kind", "one of 'cpu', 'disk'"),
        ([POOL, 7], "tiers[1]", "a mapping with a 'kind' key"),
    ],
)
def test_each_mistake_in_a_stack_is_named_by_its_path(tiers: Any, field: str, expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config({"tiers": tiers})
    assert error.value.field == field
    assert expected in error.value.expected


def test_backend_and_tiers_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="either 'backend'"):
        load_config({"tiers": [POOL, DISK], "backend": POOL})
