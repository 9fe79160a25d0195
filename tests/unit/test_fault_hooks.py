"""Fault hooks named by import path (``kvcore.kit.faults.load_hooks``) and the delay hooks of
``kvcore.testing.faults``: what the vLLM adapter's ``faults`` key resolves, and what the engine tests
hand a live engine."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvcore.errors import ConfigError, UsageError
from kvcore.kit.faults import FaultHooks, load_hooks
from kvcore.ports import Direction
from kvcore.testing.faults import InjectedFaults, TransferDelays

SHARED = InjectedFaults()
NOT_HOOKS = object()


class NeedsArguments(FaultHooks):
    def __init__(self, limit: float) -> None:
        self.limit = limit


def make_hooks() -> FaultHooks:
    return TransferDelays()


def test_a_path_names_one_shared_instance() -> None:
    assert load_hooks(f"{__name__}:SHARED") is SHARED
    assert load_hooks(f"{__name__}:SHARED") is load_hooks(f"{__name__}:SHARED")


def test_a_path_may_name_a_class_made_for_each_caller() -> None:
    first, second = (load_hooks("kvcore.testing.faults:TransferDelays") for _ in range(2))
    assert isinstance(first, TransferDelays)
    assert first is not second


@pytest.mark.parametrize(
    "path",
    [
        "tests.unit.test_fault_hooks",  # no name
        ":SHARED",  # no module
        f"{__name__}:SHARED.attr",  # not an identifier
        f"{__name__}:",
        7,
        None,
        "tests.unit.no_such_module:SHARED",
        f"{__name__}:MISSING",
        f"{__name__}:NOT_HOOKS",
        "kvcore.errors:ConfigError",  # a class, not of hooks
        f"{__name__}:make_hooks",  # a function: not called
        f"{__name__}:NeedsArguments",  # hooks, but not made with no arguments
    ],
)
def test_a_path_that_names_no_hooks_is_refused_by_field_and_value(path: object) -> None:
    with pytest.raises(ConfigError) as error:
        load_hooks(path, field="extra.faults")
    assert (error.value.field, error.value.value) == ("extra.faults", path)


def test_delays_slow_one_direction_until_cleared() -> None:
    delays = TransferDelays()
    assert delays.before_transfer(Direction.SAVE, 3) == 0
    delays.slow(Direction.SAVE, 0.2)
    started = time.monotonic()
    assert delays.before_transfer(Direction.LOAD, 3) == 0  # the other direction is not slowed
    assert time.monotonic() - started < 0.1
    assert delays.before_transfer(Direction.SAVE, 3) == 0
    assert time.monotonic() - started >= 0.2
    delays.clear()
    started = time.monotonic()
    delays.before_transfer(Direction.SAVE, 3)
    assert time.monotonic() - started < 0.1


def test_delays_change_while_a_transfer_sleeps() -> None:
    delays = TransferDelays()
    delays.slow(Direction.LOAD, 0.3)
    sleeper = threading.Thread(target=delays.before_transfer, args=(Direction.LOAD, 1))
    sleeper.start()
    delays.clear()  # does not wait for the sleeping transfer
    sleeper.join(5)
    assert not sleeper.is_alive()


@pytest.mark.parametrize(
    ("direction", "delay"), [("save", 1.0), (Direction.SAVE, -1.0), (Direction.LOAD, 1e9)]
)
def test_bad_delays_are_refused_by_name(direction: object, delay: float) -> None:
    with pytest.raises(UsageError, match="direction" if isinstance(direction, str) else "delay_s"):
        TransferDelays().slow(direction, delay)  # type: ignore[arg-type]  # refused at run time


def test_a_module_that_fails_as_it_is_imported_is_refused_by_field_and_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvcore_broken_hooks.py").write_text("raise RuntimeError('half-written module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="half-written module") as error:
        load_hooks("kvcore_broken_hooks:HOOKS")
    assert (error.value.field, error.value.value) == ("faults", "kvcore_broken_hooks:HOOKS")
