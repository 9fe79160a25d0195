"""The architecture's arrows, enforced: the core imports no adapter or backend; a backend imports neither
an adapter nor another backend; adapters do not import each other. Every import counts — at module level
or inside a function (a lazy import is still a dependency) — read from the source with ``ast``. And the
core spells no backend's kind: backends are found through the registry only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvcore.plugins.registry import backends

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "kvcore": ("core", ROOT / "kvcore"),
    "kvcore_cli": ("adapter", ROOT / "adapters" / "kvcore_cli"),
    "kvcore_vllm": ("adapter", ROOT / "adapters" / "kvcore_vllm"),
    "kvcore_cpu": ("backend", ROOT / "backends" / "kvcore_cpu"),
    "kvcore_mooncake": ("backend", ROOT / "backends" / "kvcore_mooncake"),
    "kvcore_lmcache": ("backend", ROOT / "backends" / "kvcore_lmcache"),
    "kvcore_disk": ("backend", ROOT / "backends" / "kvcore_disk"),
    "kvcore_dirstore": ("backend", ROOT / "docs" / "examples" / "dirstore" / "kvcore_dirstore"),
}
ALLOWED = {"core": {"core"}, "backend": {"core"}, "adapter": {"core", "backend"}}
"""Which layers each layer may import besides itself (its own package)."""


def _imports(path: Path) -> set[str]:
    """Top-level package names a module imports (absolute imports; relative ones stay in the package)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _violations(package: str) -> list[str]:
    layer, root = PACKAGES[package]
    out = []
    for path in sorted(root.rglob("*.py")):
        for name in sorted(_imports(path) & PACKAGES.keys() - {package}):
            if PACKAGES[name][0] not in ALLOWED[layer]:
                out.append(f"{path.relative_to(ROOT)} imports {name} ({layer} -> {PACKAGES[name][0]})")
    return out


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_point_inward(package: str) -> None:
    assert _violations(package) == []


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kvcore_vllm.settings import x\n    import kvcore_cpu.tier\n")
    assert _imports(module) == {"kvcore_vllm", "kvcore_cpu"}


def test_the_core_spells_no_backend_kind() -> None:
    kinds = set(backends())
    spelled = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
        for path in sorted((ROOT / "kvcore").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in kinds
    ]
    assert kinds >= {"cpu", "mooncake_store", "lmcache_mp", "disk"}
    assert spelled == []


# -- inside the core: the rooms ----------------------------------------------------------------------------

VOCABULARY = {"errors", "ids", "checks", "jobs"}
"""What every room may import: kvcore's own vocabulary (``kvcore.errors``, ``ids``, ``checks``, ``jobs``)."""
ROOMS: dict[str, set[str]] = {
    "ports": set(),
    "kit": {"ports"},
    "model": {"ports", "keying"},
    "keying": set(),
    "config": {"keying", "kit", "plugins"},
    "pool": {"kit", "model", "ports"},
    "scheduling": {"config", "keying", "kit", "model", "pool", "ports"},
    "execution": {"keying", "kit", "model", "ports"},
    "plugins": {"config", "execution", "kit", "model", "ports", "scheduling"},
    "testing": {"config", "execution", "kit", "model", "plugins", "ports"},
}
"""The rooms of ``kvcore/`` and those each may import besides its own and the vocabulary: the scheduling and
the execution sides never import each other (what both need lives in ``model``, ``ports`` or ``kit``); the
kit and the ports import no domain room; only ``plugins`` (and ``testing``) knows both sides."""
MODULES = {"config/model.py": {"keying", "kit"}, "config/tiers.py": {"kit"}}
"""Modules held to less than their room: the config model does not import plugin discovery (only
``config/loading.py`` reads the registry)."""


def _core_imports(path: Path) -> set[str]:
    """The rooms (or vocabulary modules) of ``kvcore`` a core module imports, lazily or not."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            else []
        )
        found.update(n.split(".")[1] for n in names if n.startswith("kvcore.") and n.count(".") >= 1)
    return found


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_each_room_imports_only_the_rooms_it_may(room: str) -> None:
    wrong = []
    for path in sorted((ROOT / "kvcore" / room).rglob("*.py")):
        relative = path.relative_to(ROOT / "kvcore").as_posix()
        allowed = MODULES.get(relative, ROOMS[room]) | VOCABULARY | {room}
        wrong += [f"{relative} imports kvcore.{name}" for name in sorted(_core_imports(path) - allowed)]
    assert wrong == []


def test_every_room_is_listed_and_the_top_level_holds_only_the_vocabulary() -> None:
    rooms = {p.name for p in (ROOT / "kvcore").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == set(ROOMS)
    modules = {p.stem for p in (ROOT / "kvcore").glob("*.py")}
    assert modules == VOCABULARY | {"__init__", "_moved"}


def test_the_room_check_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from kvcore.scheduling.scheduler import x\n    import kvcore.execution.worker\n"
    )
    assert _core_imports(module) == {"scheduling", "execution"}
