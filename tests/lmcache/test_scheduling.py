"""An LMCache server the tests start shares the CPU scheduling group of the test process and its engines.

Linux gives every session a scheduling group of its own (autogroup) that competes for the CPU as one
entity. A vLLM engine at TP 2 on this machine's two cores keeps both busy while it waits on the server
(empty steps, and ranks pinned one per core that busy-poll between steps). With the server in a session
of its own, it was measured runnable and unscheduled for seconds on end, the engine's waits on it ran
into their timeouts, and ``test_vllm_tp2`` failed about 5 runs in 6 on a shared machine: saves counted
failed, the server marked down, loads served as misses (see ``launcher.py``). In the test's own group,
the server's threads are scheduled one by one against the engine's, and answer in milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.lmcache.conftest import LMCacheServer


def _scheduling_group(pid: int) -> tuple[int, str]:
    """The session of process ``pid`` and its autogroup (``""`` where the kernel has none or shows none:
    some kernels and sandboxes keep the file and leave it empty)."""
    autogroup = Path(f"/proc/{pid}/autogroup")
    fields = autogroup.read_text().split() if autogroup.exists() else []
    return os.getsid(pid), fields[0] if fields else ""


def test_a_server_is_scheduled_with_the_tests_and_is_a_process_group_of_its_own(
    lmcache_server: LMCacheServer,
) -> None:
    assert lmcache_server.pid is not None
    assert _scheduling_group(lmcache_server.pid) == _scheduling_group(os.getpid())
    # killed, paused and resumed as one group (the server has children of its own)
    assert os.getpgid(lmcache_server.pid) == lmcache_server.pid != os.getpgid(0)
