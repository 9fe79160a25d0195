"""Broken variants of the in-memory reference store and index, each with one defect a backend author could
ship, run through the conformance suite: every variant must fail it (the suite has no blind spot there).

Run it as a script (``python -m tests.conformance.mutants``): it runs the suite against every variant
in one pytest process, prints which tests killed each, and exits 1 if any variant passed.
``tests/conformance/test_mutants.py`` runs it under ``make test``. The module is not collected by the
test run itself (its name does not start with ``test_``): its test classes run only through ``main``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path

from kvcore.errors import BackendError
from kvcore.ids import ChunkKey, JobId, LookupId
from kvcore.jobs import JobResult
from kvcore.ports import StoreItem
from kvcore.testing.index import ChunkIndexTests
from kvcore.testing.memory import InMemoryChunkIndex, InMemoryChunkStore
from kvcore.testing.memory.common import Work
from kvcore.testing.store import ChunkStoreTests
from tests.conformance.test_memory_conformance import (
    MemoryIndexHarness,
    MemoryStoreHarness,
    memory_index_harness,
    memory_store_harness,
)

__all__ = ["main"]


class ExistsSwallowsErrors(InMemoryChunkStore):
    """``exists`` answers "absent" when the server cannot be asked."""

    def exists(self, keys: Sequence[ChunkKey]) -> tuple[bool, ...]:
        try:
            return super().exists(keys)
        except BackendError:
            return tuple(False for _ in keys)


class CloseForgetsQueuedJobs(InMemoryChunkStore):
    """``close`` stops the job thread and drops what is queued: those job ids stay pending forever."""

    def close(self) -> None:
        super().close()
        self._forget = True

    def _run(self, job_id: JobId, work: Work) -> None:
        self._faults.wait_released()
        if not getattr(self, "_forget", False):
            self._board.finish(work(job_id))


class CloseTakesNewJobs(InMemoryChunkStore):
    """``close`` does not refuse new submits: their job ids stay pending forever."""

    def _submit(self, work: Work) -> JobId:
        if not self._closed:
            return super()._submit(work)
        return self._board.new()


class CloseLeavesRefusedJobsPending(InMemoryChunkStore):
    """``close`` shuts the job lane without marking the store closed: a later submit is refused by the
    lane (its message says "closed"), after it took a job id that stays pending forever."""

    def close(self) -> None:
        self._lane.close(1.0)

    def _submit(self, work: Work) -> JobId:
        with self._cond:
            job_id = self._board.new()
            self._lane.submit(partial(self._run, job_id, work), partial(self._fail, job_id))
            return job_id


class PartialFailureFailsEverything(InMemoryChunkStore):
    """A get with one miss reports every item failed (the hits are wasted)."""

    def _get(self, items: tuple[StoreItem, ...], leased: tuple[ChunkKey, ...], job_id: JobId) -> JobResult:
        result = super()._get(items, leased, job_id)
        return JobResult(job_id, tuple(range(len(items)))) if result.failed else result


class PutOverwrites(InMemoryChunkStore):
    """A put of a present key replaces its value (a content address with two contents)."""

    def submit_put(self, items: Sequence[StoreItem]) -> JobId:
        self.remove([item.key for item in items])
        return super().submit_put(items)


class LookupAnswersZeroWhenDown(InMemoryChunkIndex):
    """A lookup the server cannot answer answers 0 (a miss), so no breaker opens and nobody is warned."""

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        try:
            return super().poll_lookup(lookup_id)
        except BackendError:
            return 0


class LookupCountsPastAMiss(InMemoryChunkIndex):
    """A lookup counts every present chunk, not the leading ones."""

    def _count(self, chunks: Iterable[Sequence[ChunkKey]]) -> int:
        return sum(1 for chunk in chunks if all(k in self._keys for k in chunk))


STORE_MUTANTS = (
    ExistsSwallowsErrors,
    CloseForgetsQueuedJobs,
    CloseTakesNewJobs,
    CloseLeavesRefusedJobsPending,
    PartialFailureFailsEverything,
    PutOverwrites,
)
INDEX_MUTANTS = (LookupAnswersZeroWhenDown, LookupCountsPastAMiss)


def _store_suite(mutant: type[InMemoryChunkStore]) -> type:
    class Suite(ChunkStoreTests[InMemoryChunkStore]):
        def make_harness(self) -> contextlib.AbstractContextManager[MemoryStoreHarness]:
            return memory_store_harness(mutant)

    Suite.__name__ = Suite.__qualname__ = f"Test{mutant.__name__}"
    return Suite


def _index_suite(mutant: type[InMemoryChunkIndex]) -> type:
    class Suite(ChunkIndexTests[InMemoryChunkIndex]):
        def make_harness(self) -> contextlib.AbstractContextManager[MemoryIndexHarness]:
            return memory_index_harness(index_class=mutant)

    Suite.__name__ = Suite.__qualname__ = f"Test{mutant.__name__}"
    return Suite


for _mutant in STORE_MUTANTS:
    globals()[f"Test{_mutant.__name__}"] = _store_suite(_mutant)
for _index_mutant in INDEX_MUTANTS:
    globals()[f"Test{_index_mutant.__name__}"] = _index_suite(_index_mutant)


def run() -> dict[str, list[str]]:
    """Run the suite against every variant (one pytest process); the tests that failed, by variant."""
    names = [m.__name__ for m in (*STORE_MUTANTS, *INDEX_MUTANTS)]
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "mutants.xml"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-W",
                "ignore::pytest.PytestUnraisableExceptionWarning",
                f"--junitxml={report}",
                "-o",
                "timeout=30",
                __file__,
            ],
            check=False,
            capture_output=True,
            cwd=Path(__file__).parents[2],
        )
        killed: dict[str, list[str]] = {name: [] for name in names}
        for case in ET.parse(report).getroot().iter("testcase"):
            variant = case.get("classname", "").rsplit(".", 1)[-1].removeprefix("Test")
            if variant in killed and (case.find("failure") is not None or case.find("error") is not None):
                killed[variant].append(case.get("name", "?"))
    return killed


def main() -> int:
    survivors = 0
    for variant, tests in run().items():
        if tests:
            print(f"killed   {variant}: {', '.join(sorted(tests)[:3])}{' ...' if len(tests) > 3 else ''}")
        else:
            survivors += 1
            print(f"SURVIVED {variant}: the conformance suite passed it")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
