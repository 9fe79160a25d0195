"""Reading kvcore's configuration out of vLLM's ``kv_connector_extra_config``, and writing it for users.

The extra config is kvcore's own config (``kvcore.config``), validated by the core's strict converter, or
``{"config_file": PATH}`` naming a JSON or YAML file that holds it. Errors name the field and the value.
One key belongs to the adapter rather than the core: ``store_policy`` (which blocks of vLLM's cache are
saved, and when), taken out before the core's converter, which refuses keys it does not know.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attrs import frozen

from kvcore.config import KVCoreConfig, load_config, parse_size
from kvcore.errors import ConfigError
from kvcore_vllm import CONNECTOR_NAME

__all__ = ["StorePolicy", "VLLMSettings", "read_extra_config", "transfer_config"]

BACKEND_CHOICES = ("cpu", "mooncake", "lmcache")
DEFAULT_ENDPOINTS = {"mooncake": "127.0.0.1:50051", "lmcache": "tcp://localhost:5555"}
DEFAULT_SIZE = "8GiB"
STORE_POLICY_KEY = "store_policy"


class StorePolicy(enum.Enum):
    """Which of vLLM's blocks kvcore saves.

    ``EAGER``: every full chunk of real tokens as soon as it is computed (optionally only after
    ``save_after_sightings`` lookups). ``LAZY``: only chunks whose blocks vLLM evicts from its own prefix
    cache, copied just before the block is reused; what stays in vLLM's cache costs no copy.
    """

    EAGER = "eager"
    LAZY = "lazy"


@frozen
class VLLMSettings:
    """The core's config plus the adapter's own choice of store policy."""

    core: KVCoreConfig
    store_policy: StorePolicy = StorePolicy.EAGER


def read_extra_config(extra: Mapping[str, Any]) -> VLLMSettings:
    """The validated settings from ``kv_connector_extra_config``."""
    if "config_file" not in extra:
        return _settings(extra)
    if len(extra) != 1:
        others = sorted(k for k in extra if k != "config_file")
        raise ConfigError("kv_connector_extra_config", others, "either 'config_file' alone, or the config")
    path = Path(str(extra["config_file"]))
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("config_file", str(path), f"a readable file ({exc.strerror})") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml  # vLLM depends on PyYAML; only YAML configs need it

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("config_file", str(path), f"valid YAML ({exc})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("config_file", str(path), f"valid JSON ({exc})") from None
    if not isinstance(data, Mapping):
        raise ConfigError("config_file", str(path), "a file holding a mapping")
    return _settings(data)


def _settings(data: Mapping[str, Any]) -> VLLMSettings:
    core = {k: v for k, v in data.items() if k != STORE_POLICY_KEY}
    raw = data.get(STORE_POLICY_KEY, StorePolicy.EAGER.value)
    choices = [p.value for p in StorePolicy]
    if raw not in choices:
        raise ConfigError(STORE_POLICY_KEY, raw, f"one of {', '.join(map(repr, choices))}")
    settings = VLLMSettings(load_config(core), StorePolicy(raw))
    if settings.store_policy is StorePolicy.LAZY and settings.core.save_after_sightings > 1:
        raise ConfigError(
            STORE_POLICY_KEY,
            raw,
            "'eager' when save_after_sightings > 1 (a lazy save is decided at eviction, not by sightings)",
        )
    return settings


def transfer_config(
    backend: str = "cpu", size: str | None = None, role: str = "kv_both", endpoint: str | None = None
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value for kvcore, in the spirit of vLLM's one-knob offloading options.

    ``backend`` is ``cpu``, ``mooncake`` (a Mooncake store; ``endpoint`` is its master, default
    ``127.0.0.1:50051``) or ``lmcache`` (an LMCache server; ``endpoint`` is its URL, default
    ``tcp://localhost:5555``); ``size`` is the host pool, total across ranks (default 8 GiB; for
    ``lmcache`` none: blocks move straight to and from the server's memory, and a size puts a pool in
    front). The result is validated before it is returned, so what is printed is what the engine will
    accept.
    """
    if backend not in BACKEND_CHOICES:
        raise ConfigError("backend", backend, f"one of {', '.join(map(repr, BACKEND_CHOICES))}")
    if size is None and backend != "lmcache":
        size = DEFAULT_SIZE
    if size is not None:
        parse_size(size, "size")
    if backend == "cpu":
        if endpoint is not None:
            raise ConfigError("endpoint", endpoint, "nothing: the cpu backend has no endpoint")
        tier: dict[str, Any] = {"kind": "cpu", "size": size}
    elif backend == "mooncake":
        tier = {
            "kind": "mooncake_store",
            "master": endpoint or DEFAULT_ENDPOINTS[backend],
            "local_size": size,
        }
    else:
        tier = {"kind": "lmcache_mp", "url": endpoint or DEFAULT_ENDPOINTS[backend], "local_size": size or 0}
    extra: dict[str, Any] = {"backend": tier}
    load_config(extra)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
