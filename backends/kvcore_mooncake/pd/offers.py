"""``OfferBook``: which transfers a producer rank holds, and for whom -- bookkeeping alone.

An offer holds a finished prefill's blocks under a transfer id. Each consumer rank accounts for it: with
a ``Release`` at once, with a ``Pull`` once its write ended and the notice about it was delivered. The
book frees an offer -- reports it through ``poll_freed`` and remembers why, to answer late requests --
when every consumer rank is accounted for, when ``abort_timeout_s`` passed since the offer, or after
``abort``; never while a write that reads its blocks is in flight. Requests that arrive before their
offer are parked for at most ``abort_timeout_s``.

No threads, no sockets, no transport: time comes from the clock it is given, so that every rule can be
checked step by step. The producer calls it under its own lock; the book itself is not thread-safe.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable, Sequence

from attrs import frozen

from kvcore.errors import InvalidSpecError
from kvcore_mooncake.pd.messages import Ack, Pull, Refused, Release

__all__ = ["FreeReason", "FreedTransfer", "OfferBook"]

log = logging.getLogger(__name__)

_REMEMBER = 4096  # finished transfer ids kept to answer late requests clearly


class FreeReason(enum.Enum):
    DELIVERED = "delivered"  # every consumer rank acknowledged or released
    TIMED_OUT = "timed_out"  # abort_timeout_s passed first
    ABORTED = "aborted"  # the engine called abort


@frozen
class FreedTransfer:
    """The blocks offered under ``transfer_id`` are no longer read: the engine may reuse them."""

    transfer_id: str
    reason: FreeReason


class _Offer:
    """A held transfer (hot-path mutable record)."""

    __slots__ = ("aborted", "accounted", "blocks", "deadline", "expected", "pulled", "writes")

    def __init__(self, blocks: frozenset[int], deadline: float) -> None:
        self.blocks = blocks
        self.deadline = deadline
        self.expected: int | None = None  # the consumer's TP size, from its first pull or release
        self.accounted: set[int] = set()
        self.pulled: set[int] = set()
        self.writes = 0
        self.aborted = False


class OfferBook:
    """The offers of one producer rank, the requests parked for them, and the freed ones to report."""

    def __init__(self, abort_timeout_s: float, clock: Callable[[], float]) -> None:
        self._timeout = abort_timeout_s
        self._clock = clock
        self._offers: dict[str, _Offer] = {}
        self._parked: dict[str, list[tuple[Pull | Release, float]]] = {}
        self._finished: collections.OrderedDict[str, FreeReason] = collections.OrderedDict()
        self._freed: list[FreedTransfer] = []

    def offer(self, transfer_id: str, blocks: Sequence[int]) -> tuple[Pull | Release, ...]:
        """Hold ``blocks`` for ``transfer_id``; returns the requests parked for it, oldest first, for the
        caller to ``admit`` now. Raises ``InvalidSpecError`` for a transfer id held or finished here."""
        if transfer_id in self._offers or transfer_id in self._finished:
            raise InvalidSpecError(f"offer: transfer {transfer_id!r} is already known here")
        self._offers[transfer_id] = _Offer(frozenset(blocks), self._clock() + self._timeout)
        return tuple(request for request, _ in self._parked.pop(transfer_id, []))

    def admit(self, request: Pull | Release, consumer_tp: int) -> Ack | Refused | Pull:
        """Take a consumer rank's request (from a consumer of TP size ``consumer_tp``).

        Returns the reply to send at once, or the ``Pull`` itself when it is new for a held offer: the
        caller plans its write, then calls ``pulled`` (or refuses it, which leaves the offer as it was).
        A release is accounted, and may free the offer; a request for an unknown transfer is parked.
        """
        transfer_id = request.transfer_id
        reason = self._finished.get(transfer_id)
        if reason is not None:
            if isinstance(request, Release):
                return Ack()
            return Refused(f"transfer {transfer_id!r} already ended here ({reason.value})")
        offer = self._offers.get(transfer_id)
        if offer is None:
            self._parked.setdefault(transfer_id, []).append((request, self._clock() + self._timeout))
            return Ack()
        if offer.aborted:
            return Refused(f"transfer {transfer_id!r} was aborted by the producer")
        if offer.expected not in (None, consumer_tp):
            return Refused(
                f"transfer {transfer_id!r} is pulled by a TP {offer.expected} consumer, not TP {consumer_tp}"
            )
        offer.expected = consumer_tp
        if isinstance(request, Release):
            offer.accounted.add(request.tp_rank)
            self._free_if_done(transfer_id, offer)
            return Ack()
        if request.tp_rank in offer.pulled:
            return Ack()  # a retried pull
        missing = set(request.all_src_blocks) - offer.blocks
        if missing:
            return Refused(f"blocks {sorted(missing)[:8]} are not part of transfer {transfer_id!r}")
        return request

    def pulled(self, pull: Pull, *, writes: bool) -> None:
        """``pull`` (as ``admit`` returned it) started: with a write in flight, or with nothing to write
        (its notice goes out at once)."""
        offer = self._offers[pull.transfer_id]
        offer.pulled.add(pull.tp_rank)
        if writes:
            offer.writes += 1

    def write_ended(self, transfer_id: str) -> None:
        """A write of ``transfer_id`` ended (either way): its blocks are no longer read by it."""
        offer = self._offers.get(transfer_id)
        if offer is not None:
            offer.writes -= 1
            self._free_if_done(transfer_id, offer)

    def delivered(self, transfer_id: str, consumer_rank: int) -> None:
        """The consumer rank answered the notice about its pull: it is accounted for."""
        offer = self._offers.get(transfer_id)
        if offer is not None:
            offer.accounted.add(consumer_rank)
            self._free_if_done(transfer_id, offer)

    def abort(self, transfer_id: str) -> tuple[Pull | Release, ...]:
        """Stop serving ``transfer_id``: later requests are refused, the blocks freed once no write reads
        them. Returns the requests parked for it, which will never be served. Unknown ids are ignored."""
        offer = self._offers.get(transfer_id)
        if offer is not None:
            offer.aborted = True
            self._free_if_done(transfer_id, offer)
        return tuple(request for request, _ in self._parked.pop(transfer_id, []))

    def expire(self) -> tuple[Pull | Release, ...]:
        """Free the offers past their deadline that no write reads; drop and return the parked requests
        past theirs (their offer never came)."""
        now = self._clock()
        for transfer_id, offer in list(self._offers.items()):
            if offer.deadline <= now:
                self._free_if_done(transfer_id, offer)
        late: list[Pull | Release] = []
        for transfer_id, parked in list(self._parked.items()):
            late.extend(request for request, deadline in parked if deadline <= now)
            kept = [(request, deadline) for request, deadline in parked if deadline > now]
            if kept:
                self._parked[transfer_id] = kept
            else:
                del self._parked[transfer_id]
        return tuple(late)

    def poll_freed(self) -> tuple[FreedTransfer, ...]:
        """Transfers freed since the last call, each reported once."""
        freed, self._freed = tuple(self._freed), []
        return freed

    def held(self) -> int:
        """How many transfers hold blocks now."""
        return len(self._offers)

    def waiting(self) -> int:
        """How many requests are parked, waiting for their transfer's offer."""
        return sum(len(parked) for parked in self._parked.values())

    def _free_if_done(self, transfer_id: str, offer: _Offer) -> None:
        """Free the offer's blocks if nothing reads them and nobody waits for them."""
        if offer.writes:
            return
        if offer.aborted:
            reason = FreeReason.ABORTED
        elif offer.expected is not None and len(offer.accounted) >= offer.expected:
            reason = FreeReason.DELIVERED
        elif offer.deadline <= self._clock():
            reason = FreeReason.TIMED_OUT
            log.warning(
                "transfer %s: freeing its blocks after %.1fs; consumer ranks accounted: %s of %s",
                transfer_id,
                self._timeout,
                sorted(offer.accounted),
                offer.expected,
            )
        else:
            return
        del self._offers[transfer_id]
        self._finished[transfer_id] = reason
        if len(self._finished) > _REMEMBER:
            self._finished.popitem(last=False)
        self._freed.append(FreedTransfer(transfer_id, reason))
