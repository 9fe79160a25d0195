"""Reading kvcore's configuration out of vLLM's ``kv_connector_extra_config``, and writing it for users.

The extra config is kvcore's own config (``kvcore.config``), validated by the core's strict converter, or
``{"config_file": PATH}`` naming a JSON or YAML file that holds it. Errors name the field and the value.
Three keys belong to the adapter rather than the core, taken out before the core's converter, which
refuses keys it does not know: ``store_policy`` (which blocks of vLLM's cache are saved, and when),
``load_mode`` (whether a load holds vLLM's step or the request waits for it alone) and ``faults`` (an
import path of ``kvcore.kit.faults.FaultHooks`` that each rank's movers call: vLLM builds the workers, so
tests and instrumentation name their hooks here instead of handing them to ``kvcore.plugins.compose``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, TypeVar

from attrs import frozen

from kvcore.config import KVCoreConfig, load_config, read_config_file
from kvcore.errors import ConfigError
from kvcore.kit.faults import FaultHooks, load_hooks

__all__ = [
    "ADAPTER_KEYS",
    "LoadMode",
    "StorePolicy",
    "VLLMSettings",
    "core_mapping",
    "extra_mapping",
    "load_yaml",
    "read_extra_config",
]

STORE_POLICY_KEY = "store_policy"
LOAD_MODE_KEY = "load_mode"
FAULTS_KEY = "faults"
ADAPTER_KEYS = (STORE_POLICY_KEY, LOAD_MODE_KEY, FAULTS_KEY)
"""The keys of the extra config that are the adapter's, not the core's."""

_E = TypeVar("_E", bound=enum.Enum)


class StorePolicy(enum.Enum):
    """Which of vLLM's blocks kvcore saves.

    ``EAGER``: every full chunk of real tokens as soon as it is computed (optionally only after
    ``save_after_sightings`` lookups). ``LAZY``: only chunks whose blocks vLLM evicts from its own prefix
    cache, copied just before the block is reused; what stays in vLLM's cache costs no copy.
    """

    EAGER = "eager"
    LAZY = "lazy"


class LoadMode(enum.Enum):
    """How a load runs in vLLM.

    ``SYNC``: in the step that schedules the request, before the forward pass, which waits for it (the
    whole batch with it). ``ASYNC``: the request waits (``WAITING_FOR_REMOTE_KVS``) while its load runs
    beside the engine's steps, and is scheduled once every rank reported it. ``AUTO`` (the default):
    asynchronous when the load reads from a remote tier, synchronous from the local host pool, where a
    copy takes less than the step an asynchronous load costs.
    """

    AUTO = "auto"
    SYNC = "sync"
    ASYNC = "async"


@frozen
class VLLMSettings:
    """The core's config plus the adapter's own choices: store policy, load mode, fault hooks; and
    whether the config set ``chunk_tokens`` (a hybrid SSM model takes its block size where it did not)."""

    core: KVCoreConfig
    store_policy: StorePolicy = StorePolicy.EAGER
    load_mode: LoadMode = LoadMode.AUTO
    faults: FaultHooks | None = None
    chunk_tokens_set: bool = True


def read_extra_config(extra: Mapping[str, Any]) -> VLLMSettings:
    """The validated settings from ``kv_connector_extra_config``."""
    return _settings(extra_mapping(extra))


def extra_mapping(extra: Mapping[str, Any]) -> Mapping[str, Any]:
    """kvcore's config as ``kv_connector_extra_config`` gives it: the mapping itself, or the one its
    ``config_file`` holds (JSON, or YAML for ``.yaml``/``.yml``: ``read_config_file``). Raises
    ``ConfigError`` naming ``config_file`` for a file that cannot be read or parsed."""
    if "config_file" not in extra:
        return extra
    if len(extra) != 1:
        others = sorted(k for k in extra if k != "config_file")
        raise ConfigError("kv_connector_extra_config", others, "either 'config_file' alone, or the config")
    return read_config_file(str(extra["config_file"]), yaml_load=load_yaml)


def load_yaml(text: str) -> object:
    """YAML ``text`` parsed safely (vLLM depends on PyYAML; only YAML configs need it)."""
    import yaml

    return yaml.safe_load(text)


def core_mapping(data: Mapping[str, Any]) -> dict[str, Any]:
    """The core's part of kvcore's config: every key but the adapter's own (``ADAPTER_KEYS``)."""
    return {k: v for k, v in data.items() if k not in ADAPTER_KEYS}


def _choice(data: Mapping[str, Any], key: str, kind: type[_E], default: _E) -> _E:
    raw = data.get(key, default.value)
    choices = [c.value for c in kind]
    if raw not in choices:
        raise ConfigError(key, raw, f"one of {', '.join(map(repr, choices))}")
    return kind(raw)


def _settings(data: Mapping[str, Any]) -> VLLMSettings:
    core = core_mapping(data)
    policy = _choice(data, STORE_POLICY_KEY, StorePolicy, StorePolicy.EAGER)
    settings = VLLMSettings(
        load_config(core, beside=ADAPTER_KEYS),
        policy,
        _choice(data, LOAD_MODE_KEY, LoadMode, LoadMode.AUTO),
        load_hooks(data[FAULTS_KEY], field=FAULTS_KEY) if FAULTS_KEY in data else None,
        "chunk_tokens" in data,
    )
    if settings.store_policy is StorePolicy.LAZY and settings.core.save_after_sightings > 1:
        raise ConfigError(
            STORE_POLICY_KEY,
            policy.value,
            "'eager' when save_after_sightings > 1 (a lazy save is decided at eviction, not by sightings)",
        )
    return settings
