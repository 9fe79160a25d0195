"""Starts real ``lmcache server`` processes in well under a second each, for the tests.

A server start is mostly imports (torch, numba, fastapi, LMCache's own modules): 15-25 s on a loaded
2-core machine, every time. This launcher takes them once, then forks one child per requested server;
the child runs LMCache's own command line entry point (``lmcache server ...``) in its own process group,
so it is killed, paused and resumed by that group exactly like a server started from the shell. Each
child dies with the launcher (``die_with_owner``), and the caller starts the launcher the same way: a
killed test process leaves no server behind.

Neither the launcher nor a server starts a session of its own: a new session is a new scheduling group
to Linux (autogroup), which shares the CPU with the test's group as one entity, however many threads
are runnable in each. An engine at TP 2 on two cores keeps both busy while it waits on a server (vLLM
steps an empty batch after empty batch, and each rank, pinned to its core, busy-polls between steps);
a server in a group of its own was then measured runnable and unscheduled for seconds on end (45 ms of
CPU in 19 s with up to 11 threads runnable, while the engine took 34 s), so that the engine's waits ran
into their timeouts. In the test's group, the server's threads compete one by one with the engine's
and answer in milliseconds.

Protocol, one line each way: the launcher prints ``ready`` once warm; then for each JSON request
``{"argv": [...], "log": path}`` on stdin it prints the child's pid. End of stdin ends the launcher;
the servers it started are the caller's to kill. Run as ``python launcher.py``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from kvcore.testing.support import die_with_owner

_WARM = (
    "lmcache.cli.main",
    "lmcache.cli.commands",
    "lmcache.v1.multiprocess.http_server",
)


def _serve(argv: list[str], log: str, arm: Callable[[], None]) -> NoReturn:
    """In the forked child: become a server that dies with the launcher (``arm``), never return into the
    launcher's loop."""
    code = 1
    try:
        arm()
        os.setpgid(0, 0)  # a group of its own, in the caller's session: see the module's docstring
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server waits on its own children
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        importlib.import_module("lmcache.cli.main").main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the child must never unwind into the launcher's loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    modules = [importlib.import_module(name) for name in _WARM]
    # the `server` subcommand's argument modules, imported the way `lmcache server` imports them
    modules[1].register_commands(argparse.ArgumentParser().add_subparsers(), ["server"])
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the servers
    arm = die_with_owner()  # forks happen on this (the main) thread, which lives as long as the launcher
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _serve([str(arg) for arg in request["argv"]], str(request["log"]), arm)
        print(pid, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
