"""``kvcore vllm-config``: the ``--kv-transfer-config`` value that serves vLLM with kvcore, one knob per
choice, in the spirit of vLLM's own offloading options.

It only builds a mapping (validated by kvcore's own ``load_config``): the CLI never imports the vLLM
adapter, so the connector's registered name is spelled here, and a test checks it against the adapter's.
"""

from __future__ import annotations

from typing import Any

from kvcore.config import load_config, parse_size
from kvcore.errors import ConfigError
from kvcore.kit.settings import did_you_mean

__all__ = ["BACKEND_CHOICES", "CONNECTOR_NAME", "transfer_config"]

CONNECTOR_NAME = "KVCoreConnector"
"""The name ``kvcore_vllm`` registers its connector under (a vLLM plugin)."""

BACKEND_CHOICES = ("cpu", "mooncake_store", "lmcache_mp")
"""The kinds ``--backend`` takes: the config's own names for them."""
DEFAULT_ENDPOINTS = {"mooncake_store": "127.0.0.1:50051", "lmcache_mp": "tcp://localhost:5555"}
DEFAULT_SIZE = "8GiB"


def transfer_config(
    backend: str = "cpu",
    size: str | None = None,
    role: str = "kv_both",
    endpoint: str | None = None,
    disk: str | None = None,
    disk_size: str | None = None,
    disk_write: str | None = None,
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value for kvcore, in the spirit of vLLM's one-knob offloading options.

    ``backend`` is a config kind: ``cpu``, ``mooncake_store`` (a Mooncake store; ``endpoint`` is its
    master, default ``127.0.0.1:50051``) or ``lmcache_mp`` (an LMCache server; ``endpoint`` is its URL,
    default ``tcp://localhost:5555``); ``size`` is the host pool, total across ranks (default 8 GiB; for
    ``lmcache_mp`` none: blocks move straight to and from the server's memory, and a size puts a pool in
    front). ``disk`` (a directory) puts a disk tier of ``disk_size`` bytes behind the host pool, in front
    of the Mooncake store if one is asked for: a stack of tiers (docs/disk.md), the disk written
    ``disk_write`` (``through``, the default: at each save; ``back``: when the pool is about to evict).
    A choice that would be ignored (an endpoint for ``cpu``, a disk's size or write mode without a disk)
    is refused, naming it. The result is validated before it is returned, so what is printed is what
    the engine will accept.
    """
    if backend not in BACKEND_CHOICES:
        expected = f"one of {', '.join(map(repr, BACKEND_CHOICES))}{did_you_mean(backend, BACKEND_CHOICES)}"
        raise ConfigError("backend", backend, expected)
    if size is None and backend != "lmcache_mp":
        size = DEFAULT_SIZE
    if size is not None:
        parse_size(size, "size")
    if backend == "cpu":
        if endpoint is not None:
            raise ConfigError("endpoint", endpoint, "nothing: the cpu backend has no endpoint")
        tier: dict[str, Any] = {"kind": "cpu", "size": size}
    elif backend == "mooncake_store":
        tier = {
            "kind": "mooncake_store",
            "master": endpoint or DEFAULT_ENDPOINTS[backend],
            "local_size": size,
        }
    else:
        tier = {"kind": "lmcache_mp", "url": endpoint or DEFAULT_ENDPOINTS[backend], "local_size": size or 0}
    extra: dict[str, Any] = {"backend": tier}
    if disk is not None or disk_size is not None or disk_write is not None:
        extra = {"tiers": _stack(backend, tier, disk, disk_size, disk_write)}
    load_config(extra)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _stack(
    backend: str, tier: dict[str, Any], disk: str | None, disk_size: str | None, disk_write: str | None
) -> list[dict[str, Any]]:
    """The tiers of a config with a disk: the host pool, the disk, then the shared tier if any."""
    if disk is None or disk_size is None:
        missing = "disk" if disk is None else "disk_size"
        raise ConfigError(missing, None, "a disk directory and its size, given together (with disk_write)")
    if backend == "lmcache_mp":
        raise ConfigError("disk", disk, "nothing with lmcache (its server keeps its own disk tier)")
    parse_size(disk_size, "disk_size")
    size = tier.get("size", tier.get("local_size"))
    pool = {"kind": "cpu", "size": size}
    local = {"kind": "disk", "path": disk, "size": disk_size}
    if disk_write is not None and disk_write != "through":  # the default stays implicit in what is printed
        local["write"] = disk_write
    if backend == "cpu":
        return [pool, local]
    return [pool, local, {k: v for k, v in tier.items() if k != "local_size"}]
