"""Mooncake clients listen on every interface, so their tests run only inside a loopback-only network
namespace (the test command wraps pytest in ``unshare -n``). Outside one they skip with the reason,
unless ``KVCORE_REQUIRE_NETNS=1`` (set by ``make test``), where a skip would hide a missing namespace:
then they fail.
"""

from __future__ import annotations

import os

import pytest

from benchmarks.engine_env import in_loopback_namespace

__all__ = ["in_loopback_namespace", "require_loopback_namespace"]

REQUIRED = os.environ.get("KVCORE_REQUIRE_NETNS") == "1"


def require_loopback_namespace() -> None:
    """Skip (or fail, under ``make test``) unless running inside a loopback-only namespace."""
    if in_loopback_namespace():
        return
    why = (
        "needs a loopback-only network namespace (Mooncake listens on every interface): run "
        "unshare -n sh -c 'ip link set lo up; exec pytest ...'"
    )
    if REQUIRED:
        pytest.fail(why)
    pytest.skip(why)
