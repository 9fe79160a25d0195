"""Remote lookups driven by a thread of their own, so that neither their progress nor their deadline
depends on the engine's pace.

A remote index answers through submit and poll. Polled only when the engine asks again, once per engine
step, a lookup of several rounds (an LMCache server's lookup, then its prefetch status; a stack of tiers,
one tier after the other) advances one round per step, and a deadline judged then fires whenever a step
outlasts it: a long prefill counted as the server's silence, and the hit recomputed. ``LookupPump`` polls
every watched lookup from its own thread — every 200 µs at first, less often the longer it waits, up to
every 5 ms — so each round is sent as soon as the one before it is answered, and judges the deadline
there: ``timeout_s`` after the lookup was submitted or, for a tier that tells when it last answered a
round of it (``SupportsLookupProgress``), after that answer (at most ``LONGEST`` timeouts in all); time
the thread itself could not run is not counted. What it measures is how long the tier has left the
lookup unanswered. The scheduler reads the outcome when
it asks again; an answer that arrived while the engine was busy is an answer, never a miss.

The pump and its owner share one lock around every call into the index, so an index sees one caller at
a time (from two threads). The thread starts with the first lookup (never in a process that merely
built a scheduler before forking) and stops at ``close``. Each ``outcome`` also polls the lookup it asks
for, so an engine that asks again in a tight loop of its own sees no added latency, and an unthreaded
pump (``threaded=False``) is a plain poll on each ask.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvcore.errors import BackendError, KVCoreError, TransferTimeout
from kvcore.ids import LookupId
from kvcore.ports import ChunkIndex, SupportsLookupProgress

__all__ = ["LookupPump"]

log = logging.getLogger(__name__)

FIRST_INTERVAL_S = 0.0002
LAST_INTERVAL_S = 0.005
CLOSE_S = 1.0
STALLED_S = 0.05  # a pass later than this after the last one: the thread could not run meanwhile
LONGEST = 10  # timeouts: the most a lookup whose tier keeps answering a round may take in all


class LookupPump:
    """Polls watched lookups of one index until each answers, fails or outlasts ``timeout_s``.

    ``outcome`` hands out, once, the answer (an int), the failure (a ``BackendError``: the index's own,
    or ``TransferTimeout`` once the deadline passed, the lookup then cancelled) or ``None`` while pending.
    """

    def __init__(
        self,
        index: ChunkIndex,
        timeout_s: float,
        lock: threading.Lock,
        *,
        threaded: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._index = index
        self._timeout = timeout_s
        self._index_lock = lock
        self._threaded = threaded
        self._clock = clock
        self._cond = threading.Condition()
        self._deadlines: dict[LookupId, float] = {}
        self._submitted: dict[LookupId, float] = {}
        self._outcomes: dict[LookupId, int | BackendError] = {}
        self._fresh = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch(self, lookup_id: LookupId) -> None:
        """Drive a lookup just submitted; its deadline is ``timeout_s`` from now."""
        with self._cond:
            now = self._clock()
            self._submitted[lookup_id] = now
            self._deadlines[lookup_id] = now + self._timeout
            self._fresh = True
            if self._threaded and self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="kvcore-lookups", daemon=True)
                self._thread.start()
            self._cond.notify()

    def outcome(self, lookup_id: LookupId) -> int | BackendError | None:
        """The lookup's outcome, handed out once, or ``None`` while it is pending. Asking polls the
        lookup once more, so an engine that asks in a loop of its own needs no thread (the deadline is
        judged by the thread, where there is one)."""
        thread = self._thread
        self._settle(lookup_id, judge=not (self._threaded and thread is not None and thread.is_alive()))
        with self._cond:
            return self._outcomes.pop(lookup_id, None)

    def forget(self, lookup_id: LookupId) -> None:
        """Stop driving a lookup and drop its outcome; the caller cancels it in the index."""
        with self._cond:
            self._deadlines.pop(lookup_id, None)
            self._submitted.pop(lookup_id, None)
            self._outcomes.pop(lookup_id, None)

    def tick(self) -> bool:
        """One pass: poll each watched lookup once, settling those answered, failed or past their
        deadline. Whether any is still pending."""
        with self._cond:
            watched = list(self._deadlines)
            self._fresh = False
        for lookup_id in watched:
            self._settle(lookup_id, judge=True)
        with self._cond:
            return bool(self._deadlines)

    def close(self) -> None:
        """Stop the thread (within a second); lookups still watched get no outcome. Idempotent."""
        with self._cond:
            self._closed = True
            self._deadlines.clear()
            self._submitted.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_S)

    def _settle(self, lookup_id: LookupId, *, judge: bool) -> None:
        """Poll the lookup if it is still watched, and record its outcome once it has one: both under
        the index lock, so that no second poll ever asks for an answer already handed out. ``judge``:
        a lookup past its deadline is given up."""
        with self._index_lock:
            with self._cond:
                deadline = self._deadlines.get(lookup_id)
            if deadline is None:
                return  # settled, or forgotten: its owner cancels it
            result = self._poll(lookup_id, deadline, judge)
            if result is not None:
                with self._cond:
                    self._submitted.pop(lookup_id, None)
                    if self._deadlines.pop(lookup_id, None) is not None:  # not forgotten meanwhile
                        self._outcomes[lookup_id] = result

    def _poll(self, lookup_id: LookupId, deadline: float, judge: bool) -> int | BackendError | None:
        now = self._clock()  # before the poll: a stall inside it is not the tier's silence
        try:
            answer = self._index.poll_lookup(lookup_id)
        except BackendError as exc:
            return exc
        except Exception as exc:  # an index that lost track of its lookup, or a client's own error
            return BackendError(f"the index could not poll lookup {lookup_id}: {exc!r}")
        if answer is not None:
            return answer
        if not judge or now < deadline:
            return None
        later = self._progress_deadline(lookup_id, now)
        if later is not None:
            with self._cond:
                if lookup_id in self._deadlines:  # not forgotten meanwhile
                    self._deadlines[lookup_id] = later
            return None
        try:
            self._index.cancel_lookup(lookup_id)
        except BackendError as exc:
            log.warning("kvcore: cancelling lookup %s failed: %s", lookup_id, exc)
        return TransferTimeout(f"lookup timed out: no answer within {self._timeout:.3f}s")

    def _progress_deadline(self, lookup_id: LookupId, now: float) -> float | None:
        """A later deadline for a lookup past its own whose tier answered a round within ``timeout_s``
        (``SupportsLookupProgress``): a server that answers is slow, not silent. Never past
        ``LONGEST`` timeouts from the submission."""
        if not isinstance(self._index, SupportsLookupProgress):
            return None
        try:
            progress = self._index.lookup_progress(lookup_id)
        except KVCoreError:
            return None
        with self._cond:
            submitted = self._submitted.get(lookup_id, now)
        if progress is None or progress + self._timeout <= now:
            return None
        latest = submitted + LONGEST * self._timeout
        return min(progress + self._timeout, latest) if now < latest else None

    def _extend(self, seconds: float) -> None:
        """Every watched deadline later by ``seconds``: time this thread could not look (its process
        stalled, the interpreter held elsewhere) is not the tier's silence."""
        with self._cond:
            for lookup_id in self._deadlines:
                self._deadlines[lookup_id] += seconds

    def _run(self) -> None:
        interval = FIRST_INTERVAL_S
        last = self._clock()
        while True:
            with self._cond:
                if not self._deadlines:
                    while not self._deadlines and not self._closed:
                        self._cond.wait()
                    last = self._clock()  # idle, not stalled
                if self._closed:
                    return
                if self._fresh:
                    interval = FIRST_INTERVAL_S
            now = self._clock()
            if now - last > STALLED_S:
                self._extend(now - last)
            try:
                pending = self.tick()
            except Exception:  # never let the thread die: the lookups would wait for their deadline
                log.exception("kvcore: polling remote lookups failed")
                pending = True
            last = self._clock()
            if pending:
                time.sleep(interval)
                interval = min(2 * interval, LAST_INTERVAL_S)
