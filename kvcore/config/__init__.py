"""kvcore's configuration: the model (``model``: ``KVCoreConfig``, ``PDConfig``), a stack of tiers
(``tiers``) and reading either from mappings or files (``loading``)."""

from __future__ import annotations

from kvcore.config.loading import (
    config_to_dict,
    load_config,
    load_config_file,
    load_pd_config,
    read_config_file,
    read_config_text,
)
from kvcore.config.model import KVCoreConfig, PDConfig
from kvcore.kit.settings import parse_size

__all__ = [
    "KVCoreConfig",
    "PDConfig",
    "config_to_dict",
    "load_config",
    "load_config_file",
    "read_config_file",
    "read_config_text",
    "load_pd_config",
    "parse_size",
]
