"""The index of a stack of tiers behind the pool (``CascadeIndex``): the scheduler side of
``kvcore.config.tiers``'s ``TierStack``; the worker side is ``kvcore.execution.cascade_remote``.

Each tier is asked for the chunks the tiers before it lack: the first for every chunk after the pool's
leading run, the next for the chunks after the first's leading run, and so on; the answer is the sum. A
tier whose lookup fails answers 0 and the next tier is asked for the same chunks, so a tier that is down
hides none of the others' chunks; a tier still pending when the lookup's budget is spent is cancelled and
the lookup answers what the tiers before it found.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import cast

from attrs import define

from kvcore.errors import BackendError, KVCoreError, UsageError
from kvcore.ids import ChunkKey, LookupId
from kvcore.keying.keys import lookup_keys
from kvcore.kit.closing import close_quietly
from kvcore.kit.health import CircuitBreaker
from kvcore.ports import (
    ChunkIndex,
    SupportsImmediateLookup,
    SupportsLookupProgress,
    SupportsTierUsage,
    TierUsage,
)
from kvcore.scheduling.lookup_pump import LONGEST

__all__ = ["CascadeIndex", "ImmediateCascadeIndex", "cascade_index", "tier_usage"]

log = logging.getLogger(__name__)


def tier_usage(index: ChunkIndex) -> TierUsage | None:
    """How full ``index``'s tier is, if it can tell (``SupportsTierUsage``); ``None`` if not, or if it
    fails to (logged: a metric is never worth an engine's step)."""
    if not isinstance(index, SupportsTierUsage):
        return None
    try:
        return index.usage()
    except (KVCoreError, OSError) as exc:
        log.warning("kvcore: %s could not tell its usage: %s", type(index).__name__, exc)
        return None


@define(eq=False)
class _Lookup:
    chunks: list[Sequence[ChunkKey]]
    preceding: list[Sequence[ChunkKey]]
    deadline: float  # the current tier's: ``budget_s`` from when it was asked
    asked: float  # when the current tier was asked
    stage: int = 0
    found: int = 0
    inner: LookupId | None = None


class CascadeIndex:
    """The ``ChunkIndex`` of several tiers asked in order (module docstring). ``found[i]`` counts the
    chunks tier ``i``'s lookups found.

    ``budget_s`` bounds each tier's part of a lookup, from when that tier is asked: a tier still pending
    past it is cancelled and the lookup answers what the tiers before it found (the caller's own
    timeout, ``lookup_timeout_s``, would answer 0 for all of them; it counts from the cascade's latest
    progress, ``lookup_progress``). A tier that fails ``BREAKER_FAILURES`` lookups in a row is skipped
    for a back-off (``kvcore.kit.health.CircuitBreaker``), so a tier that is down costs the others
    nothing per lookup.
    """

    BREAKER_FAILURES = 3
    BREAKER_BACKOFF_S = 5.0

    def __init__(
        self,
        indexes: Sequence[ChunkIndex],
        budget_s: float,
        clock: Callable[[], float] = time.monotonic,
        per_head: Sequence[bool] = (),
    ) -> None:
        if len(indexes) < 2:
            raise UsageError(f"indexes: got {len(indexes)}, expected at least two tiers to cascade")
        if per_head and len(per_head) != len(indexes):
            raise UsageError(f"per_head: got {len(per_head)} flags for {len(indexes)} tiers")
        self._indexes = tuple(indexes)
        self._per_head = tuple(per_head) or (False,) * len(indexes)
        self._budget = budget_s
        self._clock = clock
        self._breakers = [
            CircuitBreaker(self.BREAKER_FAILURES, self.BREAKER_BACKOFF_S, clock) for _ in indexes
        ]
        self._ids = itertools.count(1)
        self._lookups: dict[LookupId, _Lookup] = {}
        self.found = [0 for _ in indexes]

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        now = self._clock()
        lookup = _Lookup(list(chunks), list(preceding), now + self._budget, now)
        lookup_id = LookupId(next(self._ids))
        self._lookups[lookup_id] = lookup
        self._ask(lookup)
        return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        lookup = self._lookups.get(lookup_id)
        if lookup is None:
            raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
        while lookup.inner is not None:
            index, breaker = self._indexes[lookup.stage], self._breakers[lookup.stage]
            try:
                answer = index.poll_lookup(lookup.inner)
            except BackendError as exc:
                log.warning(
                    "kvcore: tier %d's lookup failed (%s): asking the next tier", lookup.stage + 1, exc
                )
                breaker.record_failure()
                answer = 0
            else:
                if answer is None:
                    if self._clock() < lookup.deadline or self._progressing(lookup, index):
                        return None
                    index.cancel_lookup(lookup.inner)  # too late: answer what the tiers before it found
                    log.warning(
                        "kvcore: tier %d's lookup took too long: answered without it", lookup.stage + 1
                    )
                    breaker.record_failure()
                    break
                breaker.record_success()
            answer = max(0, min(int(answer), len(lookup.chunks) - lookup.found))
            self.found[lookup.stage] += answer
            lookup.found += answer
            lookup.stage += 1
            self._ask(lookup)
        del self._lookups[lookup_id]
        return lookup.found

    def _progressing(self, lookup: _Lookup, index: object) -> bool:
        """Whether the current tier, past its budget, answered a round of the lookup within the budget
        (``SupportsLookupProgress``); its budget then counts from that answer, ``LONGEST`` budgets at
        most from when it was asked."""
        if lookup.inner is None or not isinstance(index, SupportsLookupProgress):
            return False
        progress = index.lookup_progress(lookup.inner)
        now = self._clock()
        if progress is None or progress + self._budget <= now or now >= lookup.asked + LONGEST * self._budget:
            return False
        lookup.deadline = progress + self._budget
        return True

    def lookup_progress(self, lookup_id: LookupId) -> float | None:
        """When the lookup last moved (``SupportsLookupProgress``): its current tier asked, or that tier's
        own latest answer to it."""
        lookup = self._lookups.get(lookup_id)
        if lookup is None:
            return None
        if lookup.inner is None:
            return lookup.asked
        index: object = self._indexes[lookup.stage]
        inner = index.lookup_progress(lookup.inner) if isinstance(index, SupportsLookupProgress) else None
        return lookup.asked if inner is None else max(lookup.asked, inner)

    def usage(self) -> tuple[TierUsage | None, ...]:
        """Each tier's usage (``tier_usage``), in order."""
        return tuple(tier_usage(index) for index in self._indexes)

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        lookup = self._lookups.pop(lookup_id, None)
        if lookup is not None and lookup.inner is not None:
            self._indexes[lookup.stage].cancel_lookup(lookup.inner)

    def close(self) -> None:
        """Close every tier's index; pending lookups are dropped."""
        self._lookups.clear()
        for index in self._indexes:
            close_quietly(index)

    def _ask(self, lookup: _Lookup) -> None:
        """Submit the lookup's chunks not found yet to its current tier, or end it (``inner`` None) once
        every chunk is found or every tier asked. A tier that refuses, or whose breaker is open, is
        skipped."""
        lookup.inner = None
        while lookup.stage < len(self._indexes) and lookup.found < len(lookup.chunks):
            rest = lookup.chunks[lookup.found :]
            before = lookup.preceding + lookup.chunks[: lookup.found]
            breaker = self._breakers[lookup.stage]
            if breaker.allow():
                try:
                    lookup.inner = self._indexes[lookup.stage].submit_lookup(
                        self._keys(lookup.stage, rest), self._keys(lookup.stage, before)
                    )
                    lookup.asked = self._clock()
                    lookup.deadline = lookup.asked + self._budget
                    return
                except BackendError as exc:
                    log.warning("kvcore: tier %d refused a lookup (%s)", lookup.stage + 1, exc)
                    breaker.record_failure()
            lookup.stage += 1

    def _keys(self, tier: int, chunks: Sequence[Sequence[ChunkKey]]) -> list[tuple[ChunkKey, ...]]:
        """``chunks`` as tier ``tier`` keys them: by each rank's shard, or by each KV head's."""
        return [lookup_keys(chunk, per_head=self._per_head[tier]) for chunk in chunks]


class ImmediateCascadeIndex(CascadeIndex):
    """A ``CascadeIndex`` whose tiers all answer at once (``SupportsImmediateLookup``: local disks), so
    that it does too and a lookup costs the engine no step."""

    def __init__(
        self,
        indexes: Sequence[SupportsImmediateLookup],
        budget_s: float,
        clock: Callable[[], float] = time.monotonic,
        per_head: Sequence[bool] = (),
    ) -> None:
        super().__init__(cast(Sequence[ChunkIndex], indexes), budget_s, clock, per_head)
        self._immediate = tuple(indexes)

    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        found = 0
        for tier, (index, breaker) in enumerate(zip(self._immediate, self._breakers, strict=True)):
            if found == len(chunks):
                break
            if not breaker.allow():
                continue
            try:
                answer = index.lookup(self._keys(tier, chunks[found:]))
            except BackendError as exc:
                log.warning("kvcore: tier %d's lookup failed (%s): asking the next tier", tier + 1, exc)
                breaker.record_failure()
                continue
            breaker.record_success()
            answer = max(0, min(int(answer), len(chunks) - found))
            self.found[tier] += answer
            found += answer
        return found


def cascade_index(
    indexes: Sequence[ChunkIndex], budget_s: float, per_head: Sequence[bool] = ()
) -> CascadeIndex:
    """The cascade of ``indexes``: immediate when every one of them is. ``per_head[i]``: tier ``i`` keeps
    a value per KV head (``kvcore.keying.keys.lookup_keys``)."""
    immediate = [index for index in indexes if isinstance(index, SupportsImmediateLookup)]
    if len(immediate) == len(indexes):
        return ImmediateCascadeIndex(immediate, budget_s, per_head=per_head)
    return CascadeIndex(indexes, budget_s, per_head=per_head)
