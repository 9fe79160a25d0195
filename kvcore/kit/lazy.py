"""Lazy package exports: a backend package names its public API at its top while importing nothing heavy until
a name is used, so that the registry can load its plugin module cheaply (``kvcore.plugins.registry``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports each name of ``homes`` (name -> the module
    defining it) on first use."""

    def attribute(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    return attribute
