"""Helpers shared by the port suites: the marker, capability requirements, job collection, threads, and
the processes (servers) a backend's tests start.

This module imports pytest; only the suite modules and tests import it, never ``kvcore.testing`` itself.
The process helpers (``start_owned``, ``die_with_owner``, ``process_started``, ``running``) use the
standard library alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import subprocess
import sys
import threading
import time
import unittest
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import pytest

from kvcore.errors import TransferTimeout
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobResult
from kvcore.ports import JobQueue, SupportsClear, SupportsImmediateLookup
from kvcore.testing.capabilities import (
    SupportsCapacity,
    SupportsFailureInjection,
    SupportsOutage,
    SupportsPendingJobs,
    SupportsPinning,
    SupportsStall,
)

__all__ = [
    "HarnessFixture",
    "RECOVERY_S",
    "SETTLE_S",
    "SHORT_S",
    "check_close",
    "check_result_handed_out_once",
    "check_wait_timeout_then_poll",
    "collect",
    "conformance",
    "die_with_owner",
    "finish_machine",
    "fresh_keys",
    "payload",
    "process_started",
    "require_capacity",
    "require_clear",
    "require_failure_injection",
    "require_immediate_lookup",
    "require_outage",
    "require_pinning",
    "require_stall",
    "run_threads",
    "running",
    "settle",
    "split",
    "start_owned",
    "wait_one",
]

conformance = pytest.mark.kvcore_conformance
"""The marker every conformance test carries (registered by ``kvcore.testing.plugin``)."""

HarnessT = TypeVar("HarnessT")

SETTLE_S = 5.0
"""How long a job or lookup that must finish may take before the test fails (nothing may hang)."""

RECOVERY_S = 60.0
"""How long a backend may take to answer again once its server is back: a breaker's back-off, a probe
that times out on a connection the outage broke, a fresh connection, perhaps twice on a loaded host (a
Mooncake client took over 20 s beside four vLLM engines on two cores)."""

SHORT_S = 0.05
"""A wait that is expected to time out."""


class HarnessFixture(Generic[HarnessT]):
    """The base of every suite: the ``harness`` fixture, built by ``make_harness``, and the marker.

    A backend's test class defines ``make_harness`` (type-checked against the suite's harness protocol).
    A harness that needs other fixtures overrides the ``harness`` fixture instead, asking for them.
    """

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [conformance]

    def make_harness(self) -> contextlib.AbstractContextManager[HarnessT]:
        """A fresh harness for one test; leaving the context tears its backend down."""
        raise NotImplementedError(
            f"{type(self).__name__} must define make_harness (or override the harness fixture)"
        )

    @pytest.fixture
    def harness(self) -> Iterator[HarnessT]:
        with self.make_harness() as harness:
            yield harness


def finish_machine(case: type[unittest.TestCase], max_examples: int, steps: int) -> None:
    """Give a state machine's test case its run length and the conformance marker."""
    from hypothesis import HealthCheck, settings

    case.settings = settings(  # type: ignore[attr-defined]  # hypothesis reads this class attribute
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    conformance(case)


def _reason(obj: object, capability: str) -> str:
    return f"{type(obj).__name__} does not declare {capability}"


def require_failure_injection(harness: object) -> SupportsFailureInjection:
    """The harness, if it can inject failures; otherwise the test skips, naming the capability."""
    if not isinstance(harness, SupportsFailureInjection):
        pytest.skip(_reason(harness, "SupportsFailureInjection"))
    return harness


def require_stall(harness: object) -> SupportsStall:
    if not isinstance(harness, SupportsStall):
        pytest.skip(_reason(harness, "SupportsStall"))
    return harness


def require_capacity(harness: object) -> SupportsCapacity:
    if not isinstance(harness, SupportsCapacity):
        pytest.skip(_reason(harness, "SupportsCapacity"))
    return harness


def require_outage(harness: object) -> SupportsOutage:
    if not isinstance(harness, SupportsOutage):
        pytest.skip(_reason(harness, "SupportsOutage"))
    return harness


def require_pinning(harness: object) -> SupportsPinning:
    if not isinstance(harness, SupportsPinning):
        pytest.skip(_reason(harness, "SupportsPinning"))
    return harness


def require_clear(backend: object) -> SupportsClear:
    """The backend, if it implements the port-level ``SupportsClear``; otherwise the test skips."""
    if not isinstance(backend, SupportsClear):
        pytest.skip(_reason(backend, "SupportsClear"))
    return backend


def require_immediate_lookup(backend: object) -> SupportsImmediateLookup:
    if not isinstance(backend, SupportsImmediateLookup):
        pytest.skip(_reason(backend, "SupportsImmediateLookup"))
    return backend


def payload(length: int, seed: object) -> bytes:
    """Reproducible random bytes (random, so that a copy of the wrong block or offset shows)."""
    return random.Random(repr(seed)).randbytes(length)


def fresh_keys(count: int, tag: str = "k") -> list[ChunkKey]:
    """Keys no other test (or earlier run against a shared tier) has used."""
    run = uuid.uuid4().hex[:12]
    return [ChunkKey(f"conformance/{run}/{tag}{i}") for i in range(count)]


def collect(queue: JobQueue, job_ids: Collection[JobId], timeout: float = SETTLE_S) -> dict[JobId, JobResult]:
    """Poll until every job reported; fails the test after ``timeout`` (a job that never ends hangs)."""
    wanted = set(job_ids)
    found: dict[JobId, JobResult] = {}
    deadline = time.monotonic() + timeout
    while True:
        found.update((r.job_id, r) for r in queue.poll() if r.job_id in wanted)
        if wanted <= found.keys():
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"jobs {sorted(wanted - found.keys())} never reported within {timeout}s")
        time.sleep(0.001)


def settle(poll: Callable[[], int | None], what: str, within_s: float = SETTLE_S) -> int:
    """Call ``poll`` until it answers (a lookup's ``None`` means pending); fails the test after
    ``within_s``."""
    deadline = time.monotonic() + within_s
    while (answer := poll()) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"{what} never answered within {within_s}s")
        time.sleep(0.001)
    return answer


def wait_one(queue: JobQueue, job_id: JobId) -> JobResult:
    """Wait for one job and return its result."""
    results = queue.wait([job_id], SETTLE_S)
    assert [r.job_id for r in results] == [job_id]
    return results[0]


def check_wait_timeout_then_poll(queue: JobQueue, stall: SupportsStall, submit: Callable[[], JobId]) -> None:
    """A wait on a held job raises ``TransferTimeout``; the job's result still arrives through poll."""
    with stall.stall():
        job_id = submit()
        with pytest.raises(TransferTimeout):
            queue.wait([job_id], SHORT_S)
    assert collect(queue, [job_id])[job_id].ok


def check_close(
    queue: JobQueue,
    close: Callable[[], None],
    submit: Callable[[], JobId],
    refused: type[Exception],
    harness: object = None,
) -> JobResult:
    """The ``close`` of a port with jobs: idempotent; a job submitted before it is still reported, once;
    a later submit raises ``refused`` saying the port is closed, and leaves no job pending (where the
    ``harness`` can count them: ``SupportsPendingJobs``); ``poll`` and ``wait`` keep working. Returns
    the earlier job's result (it finished or failed)."""
    job_id = submit()
    close()
    close()
    result = wait_one(queue, job_id)
    with pytest.raises(refused, match="closed"):
        submit()
    assert queue.poll() == ()
    assert queue.wait([], SHORT_S) == ()
    if isinstance(harness, SupportsPendingJobs):
        assert harness.pending_jobs() == 0, "a submit refused after close left its job pending forever"
    return result


def check_result_handed_out_once(queue: JobQueue, submit: Callable[[], JobId]) -> None:
    """A result taken by ``wait`` is not handed out again by ``poll`` or ``wait``."""
    job_id = submit()
    assert wait_one(queue, job_id).ok
    assert queue.wait([job_id], SHORT_S) == ()
    assert all(r.job_id != job_id for r in queue.poll())


def run_threads(count: int, target: Callable[[int], None]) -> None:
    """Run ``target(i)`` on ``count`` threads at once; re-raise the first failure."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(i: int) -> None:
        try:
            barrier.wait(SETTLE_S)
            target(i)
        except BaseException as exc:  # handed to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * SETTLE_S)
    assert not any(t.is_alive() for t in threads), "a submitting thread hung"
    if errors:
        raise errors[0]


def split(total: int, parts: int) -> Sequence[range]:
    """``parts`` disjoint, equal ranges of ``range(total)`` (the remainder unused)."""
    size = total // parts
    return [range(i * size, (i + 1) * size) for i in range(parts)]


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def start_owned(args: Sequence[str | os.PathLike[str]], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **popen)`` for a child that dies with its owner, the calling process:
    see ``die_with_owner``, and start it from the main thread (or one that lives as long as the owner).
    """
    # Ruff's PLW1509 (preexec_fn and threads): the child runs no Python that takes a lock, see below.
    return subprocess.Popen(args, preexec_fn=die_with_owner(), **popen)  # noqa: PLW1509


def die_with_owner() -> Callable[[], None]:
    """A function that makes a child process die with its owner, the process calling this now: the
    ``preexec_fn`` of ``start_owned``; after a bare ``os.fork()``, take it before the fork and call it
    first thing in the child.

    On Linux the child asks the kernel for SIGKILL when its parent goes (``prctl(PR_SET_PDEATHSIG)``,
    kept across ``exec``), and kills itself at once if the owner went before it could ask. So a server a
    test starts dies with the test process even when that is SIGKILLed and no clean-up code runs. The
    signal reaches the direct child only: a child that starts servers of its own arms them too (the
    tests' LMCache launcher does). Elsewhere the function does nothing.

    The kernel sends the signal when the *thread* that forked the child exits, not the owner process:
    start such children from the main thread, or from a thread that lives as long as the owner. A child
    started from a short-lived helper thread is killed when that thread ends, under a live owner.

    ``prctl`` is resolved here, before the fork; the child only calls it, ``os.getppid`` and
    ``os.kill``, so the function is safe in a process that runs threads. A failing ``prctl`` raises
    ``OSError`` in the child, which ``Popen`` re-raises in the owner.
    """
    if sys.platform != "linux":
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    owner = os.getpid()

    def arm() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
        if os.getppid() != owner:  # the owner died before the request: nobody is left to signal us
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def _stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter and start time (clock ticks after boot), from ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            raw = stat.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces
    return fields[0].decode(), int(fields[19])


def process_started(pid: int) -> int | None:
    """When process ``pid`` started (``None``: there is none). A pid and its start time name one process
    for good, where a pid alone may meanwhile name another (pids are reused). Linux (``/proc``)."""
    stat = _stat(pid)
    return None if stat is None else stat[1]


def running(pid: int, started: int | None = None) -> bool:
    """Whether process ``pid`` still runs: it exists and is no zombie (a zombie has exited; only its
    parent has not collected its status yet). With ``started`` (``process_started``), only the process
    that started then counts. Linux (``/proc``)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX" and (started is None or stat[1] == started)
