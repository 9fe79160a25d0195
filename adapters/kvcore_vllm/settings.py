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

from kvcore.config import KVCoreConfig, load_config
from kvcore.errors import ConfigError

__all__ = ["StorePolicy", "VLLMSettings", "read_extra_config"]

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
