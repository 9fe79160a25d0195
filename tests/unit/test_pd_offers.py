"""The P/D producer's ``OfferBook``, step by step on a fake clock: when blocks are freed and why, what a
request gets, and what waits for an offer."""

from __future__ import annotations

import pytest

from kvcore.errors import InvalidSpecError
from kvcore_mooncake.pd.messages import Ack, Pull, Refused, Release
from kvcore_mooncake.pd.offers import FreedTransfer, FreeReason, OfferBook

TIMEOUT_S = 10.0
BLOCKS = (3, 4, 5)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def book(clock: Clock) -> OfferBook:
    return OfferBook(TIMEOUT_S, clock)


def pull(rank: int, transfer_id: str = "t", blocks: tuple[int, ...] = BLOCKS) -> Pull:
    return Pull(transfer_id, "decode", rank, blocks, tuple(range(len(blocks))))


def release(rank: int, transfer_id: str = "t") -> Release:
    return Release(transfer_id, "decode", rank)


def serve(book: OfferBook, request: Pull, tp: int = 1) -> None:
    """Admit a pull, start its write and finish it, and deliver its notice."""
    assert book.admit(request, tp) == request
    book.pulled(request, writes=True)
    book.write_ended(request.transfer_id)
    book.delivered(request.transfer_id, request.tp_rank)


def test_freed_once_every_consumer_rank_is_accounted_for(book: OfferBook) -> None:
    # TP 2 consumer: rank 0 pulls and is served, rank 1 releases
    book.offer("t", BLOCKS)
    serve(book, pull(0), tp=2)
    assert book.poll_freed() == ()
    assert book.admit(release(1), 2) == Ack()
    assert book.poll_freed() == (FreedTransfer("t", FreeReason.DELIVERED),)
    assert book.poll_freed() == ()
    assert book.held() == 0


def test_an_offer_nobody_takes_is_freed_at_the_abort_timeout(book: OfferBook, clock: Clock) -> None:
    book.offer("t", BLOCKS)
    clock.now += TIMEOUT_S - 0.001
    assert book.expire() == ()
    assert book.poll_freed() == ()
    clock.now += 0.001
    book.expire()
    assert book.poll_freed() == (FreedTransfer("t", FreeReason.TIMED_OUT),)


def test_a_write_in_flight_keeps_the_blocks_past_the_timeout_and_an_abort(
    book: OfferBook, clock: Clock
) -> None:
    book.offer("t", BLOCKS)
    assert book.admit(pull(0), 1) == pull(0)
    book.pulled(pull(0), writes=True)
    clock.now += 2 * TIMEOUT_S
    book.expire()
    book.abort("t")
    assert (book.poll_freed(), book.held()) == ((), 1)
    book.write_ended("t")
    assert book.poll_freed() == (FreedTransfer("t", FreeReason.ABORTED),)


def test_a_pull_with_nothing_to_write_is_accounted_by_its_notice(book: OfferBook) -> None:
    book.offer("t", BLOCKS)
    assert book.admit(pull(0, blocks=()), 1) == pull(0, blocks=())
    book.pulled(pull(0, blocks=()), writes=False)
    book.delivered("t", 0)
    assert book.poll_freed() == (FreedTransfer("t", FreeReason.DELIVERED),)


def test_requests_before_the_offer_wait_for_it_in_order(book: OfferBook) -> None:
    assert book.admit(pull(0), 2) == Ack()
    assert book.admit(release(1), 2) == Ack()
    assert book.waiting() == 2
    assert book.offer("t", BLOCKS) == (pull(0), release(1))
    assert book.waiting() == 0


def test_requests_whose_offer_never_comes_expire_at_the_abort_timeout(book: OfferBook, clock: Clock) -> None:
    book.admit(pull(0, "early"), 1)
    clock.now += TIMEOUT_S / 2
    book.admit(pull(0, "later"), 1)
    clock.now += TIMEOUT_S / 2
    assert book.expire() == (pull(0, "early"),)
    assert book.waiting() == 1
    clock.now += TIMEOUT_S / 2
    assert book.expire() == (pull(0, "later"),)
    assert (book.waiting(), book.offer("early", BLOCKS)) == (0, ())


def test_requests_after_the_end_are_answered_with_the_reason(book: OfferBook) -> None:
    book.offer("t", BLOCKS)
    book.abort("t")
    assert book.poll_freed() == (FreedTransfer("t", FreeReason.ABORTED),)
    assert book.admit(release(0), 1) == Ack()
    assert book.admit(pull(0), 1) == Refused("transfer 't' already ended here (aborted)")
    with pytest.raises(InvalidSpecError, match="'t' is already known here"):
        book.offer("t", BLOCKS)


def test_an_abort_refuses_later_pulls_and_hands_back_the_parked_ones(book: OfferBook) -> None:
    book.admit(pull(0, "parked"), 1)
    assert book.abort("parked") == (pull(0, "parked"),)
    book.offer("t", BLOCKS)
    book.admit(pull(0), 1)
    book.pulled(pull(0), writes=True)
    book.abort("t")
    book.abort("t")
    assert book.admit(pull(1), 2) == Refused("transfer 't' was aborted by the producer")
    assert book.abort("never-offered") == ()


def test_refusals_leave_the_offer_as_it_was(book: OfferBook) -> None:
    book.offer("t", BLOCKS)
    assert book.admit(pull(0, blocks=(3, 9)), 2) == Refused("blocks [9] are not part of transfer 't'")
    assert book.admit(release(0), 2) == Ack()
    assert book.admit(pull(1), 4) == Refused("transfer 't' is pulled by a TP 2 consumer, not TP 4")
    with pytest.raises(InvalidSpecError, match="already known"):
        book.offer("t", BLOCKS)
    serve(book, pull(1), tp=2)
    assert book.poll_freed() == (FreedTransfer("t", FreeReason.DELIVERED),)


def test_a_retried_pull_starts_nothing_twice(book: OfferBook) -> None:
    book.offer("t", BLOCKS)
    assert book.admit(pull(0), 1) == pull(0)
    book.pulled(pull(0), writes=True)
    assert book.admit(pull(0), 1) == Ack()
    book.write_ended("t")
    book.delivered("t", 0)
    assert book.poll_freed() == (FreedTransfer("t", FreeReason.DELIVERED),)


def test_reports_about_freed_or_unknown_transfers_are_ignored(book: OfferBook) -> None:
    book.write_ended("unknown")
    book.delivered("unknown", 0)
    assert (book.poll_freed(), book.held()) == ((), 0)
