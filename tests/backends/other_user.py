"""Running a check as another user: a permission refused to ``nobody`` is what an engine of another user
meets (as root, the checks would not apply)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

NOBODY = 65534


def as_nobody(action: Callable[[], str]) -> str:
    """What ``action`` says in a process of the unprivileged user ``nobody``, forked from this one (that
    user may not run this venv's interpreter). Skips unless this process is root."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a process as another user")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody, the action, its outcome down the pipe
        said = "crashed"
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            said = action()
        finally:
            os.write(write, said.encode())
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the process of another user never finished")
        time.sleep(0.01)
    with os.fdopen(read, "rb") as pipe:
        return pipe.read().decode()
