"""The core's old flat module paths still import for one release: each warns, naming its new path, and
gives the very objects of the new module(s); a name the new module lacks is an ``AttributeError`` that
says where the module went."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from kvcore._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_with_its_new_one_and_gives_the_same_objects(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old][0]}"):
        module = importlib.import_module(old)
    homes = [importlib.import_module(home) for home in MOVED[old]]
    names = {name for home in homes for name in getattr(home, "__all__", ())}
    assert names
    assert set(module.__all__) == names
    for name in names:
        owner = next(home for home in homes if hasattr(home, name))
        assert getattr(module, name) is getattr(owner, name)
    with pytest.raises(AttributeError, match=f"now {MOVED[old][0]}"):
        module.no_such_name  # noqa: B018  # the attribute access is the test


def test_the_old_imports_of_a_third_party_still_run() -> None:
    # as code written against the flat layout would import, in a fresh interpreter
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "try:\n"
        "    from kvcore.scheduler import CacheScheduler\n"
        "except DeprecationWarning as exc:\n"
        "    print(exc)\n"
        "warnings.simplefilter('ignore')\n"
        "from kvcore.scheduler import CacheScheduler\n"
        "from kvcore.remote import StoreRemote, close_quietly\n"
        "from kvcore.config_fields import ByteSize, within\n"
        "from kvcore.cascade import CascadeIndex, CascadeRemote\n"
        "import kvcore.lane as lane\n"
        "print(CacheScheduler.__module__, StoreRemote.__module__,"
        " close_quietly.__module__, lane.JobLane.__module__)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.splitlines()
    assert first.startswith("kvcore.scheduler moved to kvcore.scheduling.scheduler")
    assert second.split() == [
        "kvcore.scheduling.scheduler",
        "kvcore.execution.remote",
        "kvcore.kit.closing",
        "kvcore.kit.lane",
    ]
