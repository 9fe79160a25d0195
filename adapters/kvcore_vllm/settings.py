"""Reading kvcore's configuration out of vLLM's ``kv_connector_extra_config``, and writing it for users.

The extra config is kvcore's own config (``kvcore.config``), validated by the core's strict converter, or
``{"config_file": PATH}`` naming a JSON or YAML file that holds it. Errors name the field and the value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcore.config import KVCoreConfig, load_config, parse_size
from kvcore.errors import ConfigError
from kvcore_vllm import CONNECTOR_NAME

__all__ = ["read_extra_config", "transfer_config"]

BACKEND_CHOICES = ("cpu",)


def read_extra_config(extra: Mapping[str, Any]) -> KVCoreConfig:
    """The validated config from ``kv_connector_extra_config``."""
    if "config_file" not in extra:
        return load_config(extra)
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
    return load_config(data)


def transfer_config(backend: str = "cpu", size: str = "8GiB", role: str = "kv_both") -> dict[str, Any]:
    """The ``--kv-transfer-config`` value for kvcore, in the spirit of vLLM's one-knob offloading options.

    The result is validated before it is returned, so what is printed is what the engine will accept.
    """
    if backend not in BACKEND_CHOICES:
        raise ConfigError("backend", backend, f"one of {', '.join(map(repr, BACKEND_CHOICES))}")
    parse_size(size, "size")
    extra: dict[str, Any] = {"backend": {"kind": backend, "size": size}}
    load_config(extra)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
