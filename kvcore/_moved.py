"""The module paths kvcore had before its core moved into rooms (``kit``, ``model``, ``keying``, ``pool``,
``scheduling``, ``execution``, ``config``, ``plugins``), importable for one more release: importing one
warns (``DeprecationWarning``) naming its new path, and gives a module whose names are those of the new
module (or modules, for ``kvcore.cascade``, split by side). ``kvcore`` installs the finder at import."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence

__all__ = ["MOVED", "install"]

MOVED: dict[str, tuple[str, ...]] = {
    "kvcore.admission": ("kvcore.pool.admission",),
    "kvcore.block_pool": ("kvcore.pool.block_pool",),
    "kvcore.cascade": ("kvcore.scheduling.cascade_index", "kvcore.execution.cascade_remote"),
    "kvcore.compose": ("kvcore.plugins.compose",),
    "kvcore.config_fields": ("kvcore.kit.settings",),
    "kvcore.engine": ("kvcore.model.engine",),
    "kvcore.eviction": ("kvcore.pool.eviction",),
    "kvcore.faults": ("kvcore.kit.faults",),
    "kvcore.hashing": ("kvcore.keying.hashing",),
    "kvcore.health": ("kvcore.kit.health",),
    "kvcore.immediate_index": ("kvcore.kit.immediate_index",),
    "kvcore.keys": ("kvcore.keying.keys",),
    "kvcore.lane": ("kvcore.kit.lane",),
    "kvcore.lane_store": ("kvcore.kit.lane_store",),
    "kvcore.layout": ("kvcore.model.layout",),
    "kvcore.lazy": ("kvcore.kit.lazy",),
    "kvcore.ledger": ("kvcore.scheduling.ledger",),
    "kvcore.lifecycle": ("kvcore.scheduling.lifecycle",),
    "kvcore.load_spec": ("kvcore.scheduling.load_spec",),
    "kvcore.lookup": ("kvcore.scheduling.remote_lookup",),
    "kvcore.op_draft": ("kvcore.scheduling.op_draft",),
    "kvcore.plan": ("kvcore.model.step",),
    "kvcore.pool_index": ("kvcore.pool.pool_index",),
    "kvcore.registry": ("kvcore.plugins.registry",),
    "kvcore.remote": ("kvcore.execution.remote", "kvcore.kit.closing"),
    "kvcore.request_keys": ("kvcore.scheduling.request_keys",),
    "kvcore.scheduler": ("kvcore.scheduling.scheduler",),
    "kvcore.sizing": ("kvcore.plugins.sizing",),
    "kvcore.tiers": ("kvcore.config.tiers",),
    "kvcore.transfer_plan": ("kvcore.model.transfer_plan",),
    "kvcore.worker": ("kvcore.execution.worker",),
    "kvcore.write_back": ("kvcore.pool.write_back",),
}
"""Each old module path, and the module(s) its names live in now."""


def _forwarding(name: str, homes: Sequence[str]) -> types.ModuleType:
    """A module named ``name`` whose attributes are looked up in ``homes``, in order."""
    modules = [importlib.import_module(home) for home in homes]
    module = types.ModuleType(name, f"Moved to {' and '.join(homes)}.")

    def attribute(attr: str) -> object:
        for home in modules:
            if hasattr(home, attr):
                return getattr(home, attr)
        raise AttributeError(f"module {name!r} (now {' and '.join(homes)}) has no attribute {attr!r}")

    def names() -> list[str]:
        return sorted({n for home in modules for n in getattr(home, "__all__", dir(home))})

    module.__dict__.update(__getattr__=attribute, __dir__=names, __all__=names())
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths (after every other finder: a module at the old path still wins)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        homes = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {' and '.join(homes)}; import it from there (the old path goes in the "
            "next release)",
            DeprecationWarning,
            stacklevel=_importer_level(),
        )
        return _forwarding(spec.name, homes)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module forwards."""


def _importer_level() -> int:
    """The ``stacklevel`` of the frame that imported the old path: the first one outside the import
    machinery and this module."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith("<frozen") or frame.f_code.co_filename == __file__
    ):
        frame, level = frame.f_back, level + 1
    return level


_FINDER = _Finder()


def install() -> None:
    """Put the finder at the end of ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
