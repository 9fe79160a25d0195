"""Freezing a server for an outage test: SIGSTOP, and then wait until it has really stopped.

``kill`` returns once the signal is queued; a thread already running on another core may still answer a
request or two before it stops, which on a loaded machine makes "the server answered during the outage"
a race rather than a finding. ``frozen`` returns only when every thread of the process is stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["freeze", "frozen", "thaw"]

STOP_S = 5.0


def _all_stopped(pid: int) -> bool:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            # the state follows the command name, which may hold spaces and parentheses
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        if state not in ("T", "t"):
            return False
    return True


def freeze(pid: int, *, group: bool = False) -> None:
    """SIGSTOP the process (or its process group), and return once each of its threads has stopped."""
    if group:
        os.killpg(pid, signal.SIGSTOP)
    else:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + STOP_S
    while not _all_stopped(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} still running {STOP_S}s after SIGSTOP")
        time.sleep(0.001)


def thaw(pid: int, *, group: bool = False) -> None:
    """SIGCONT the process (or its process group)."""
    if group:
        os.killpg(pid, signal.SIGCONT)
    else:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def frozen(pid: int, *, group: bool = False) -> Iterator[None]:
    """The process frozen while inside: it answers no request, as one that hangs or is cut off would;
    thawed on exit, holding what it held."""
    try:
        freeze(pid, group=group)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # it died meanwhile: the test says why
            thaw(pid, group=group)
