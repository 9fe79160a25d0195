"""Mooncake clients listen on every interface, so their tests run only inside a loopback-only network
namespace (the test command wraps pytest in ``unshare -n``). Outside one they skip with the reason,
unless ``KVCORE_REQUIRE_NETNS=1`` (set by ``make test``), where a skip would hide a missing namespace:
then they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

__all__ = ["in_loopback_namespace", "require_loopback_namespace"]

REQUIRED = os.environ.get("KVCORE_REQUIRE_NETNS") == "1"


def in_loopback_namespace() -> bool:
    """True when the only network interface is ``lo`` (a namespace made by ``unshare -n``)."""
    # /proc/net/dev follows the caller's namespace (sysfs keeps showing the host's interfaces).
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return [line.split(":", 1)[0].strip() for line in lines] == ["lo"]


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
