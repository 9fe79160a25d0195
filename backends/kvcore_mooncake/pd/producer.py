"""``PDProducer``: the prefill side of one rank. It keeps finished prefills' blocks and pushes them.

The engine ``offer``s a finished request's blocks under a transfer id. Each consumer rank handshakes
(``Hello``), then asks for the blocks it needs (``Pull``: producer block ids and its own block ids) or says
it needs none from this rank (``Release``). For a pull the producer plans the byte ranges with the core's
transfer plan, writes them into the consumer's registered blocks through the transport, and sends the
consumer a ``Notice`` (done or failed); the consumer's answer is its acknowledgement. A pull that arrives
before its offer waits for it. The blocks are freed (reported by ``poll_freed``) once every consumer rank
is accounted for, or when ``abort_timeout_s`` passed since the offer, or on ``abort`` -- never while a
write that reads them is still in flight.

Threads: the side channel answers requests; a worker submits writes, collects their results and runs
deadlines; a notifier delivers notices, so that a dead consumer delays no other transfer's writes.
"""

from __future__ import annotations

import collections
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import zmq
from attrs import frozen

from kvcore.config import PDConfig
from kvcore.errors import BackendError, InvalidSpecError, KVCoreError, UsageError
from kvcore.ids import JobId
from kvcore.jobs import JobResult
from kvcore.transfer_plan import TransferPlan
from kvcore_mooncake.pd.handshake import check_pair, rank_info
from kvcore_mooncake.pd.messages import (
    Ack,
    Hello,
    Notice,
    Pull,
    RankInfo,
    Refused,
    Release,
    Reply,
    Request,
    Welcome,
)
from kvcore_mooncake.pd.side_channel import SideChannelClient, SideChannelServer, listen_port
from kvcore_mooncake.pd.spec import RankSpec
from kvcore_mooncake.pd.transport import IntArray, MooncakePeerTransport

__all__ = ["FreeReason", "FreedTransfer", "PDProducer"]

log = logging.getLogger(__name__)

_TICK_S = 0.002  # the worker's longest sleep: how late a finished write is noticed
_REMEMBER = 4096  # finished transfer ids kept to answer late pulls clearly


class FreeReason(enum.Enum):
    DELIVERED = "delivered"  # every consumer rank acknowledged or released
    TIMED_OUT = "timed_out"  # abort_timeout_s passed first
    ABORTED = "aborted"  # the engine called abort


@frozen
class FreedTransfer:
    """The blocks offered under ``transfer_id`` are no longer read: the engine may reuse them."""

    transfer_id: str
    reason: FreeReason


@frozen(eq=False)
class _Consumer:
    info: RankInfo
    plan: TransferPlan


class _Offer:
    """A held transfer (hot-path mutable record; guarded by the producer's lock)."""

    __slots__ = ("aborted", "accounted", "blocks", "deadline", "expected", "pulled", "writes")

    def __init__(self, blocks: tuple[int, ...], deadline: float) -> None:
        self.blocks = frozenset(blocks)
        self.deadline = deadline
        self.expected: int | None = None  # the consumer's TP size, from its first pull or release
        self.accounted: set[int] = set()
        self.pulled: set[int] = set()
        self.writes = 0
        self.aborted = False


@frozen(eq=False)
class _Write:
    transfer_id: str
    consumer: _Consumer
    srcs: IntArray
    dsts: IntArray
    lengths: IntArray


@frozen(eq=False)
class _Send:
    transfer_id: str
    consumer: _Consumer
    ok: bool
    reason: str


class PDProducer:
    """One producer rank: its side channel, its held transfers, its writes. Call ``start`` first."""

    def __init__(
        self,
        spec: RankSpec,
        transport: MooncakePeerTransport,
        config: PDConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self._transport = transport
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._offers: dict[str, _Offer] = {}
        self._parked: dict[str, list[tuple[Pull | Release, float]]] = {}
        self._finished: collections.OrderedDict[str, FreeReason] = collections.OrderedDict()
        self._consumers: dict[tuple[str, int], _Consumer] = {}
        self._freed: list[FreedTransfer] = []
        self._jobs: dict[JobId, _Write] = {}
        self._writes: queue.SimpleQueue[_Write] = queue.SimpleQueue()
        self._notices: queue.SimpleQueue[_Send | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._server: SideChannelServer | None = None
        self._threads: list[threading.Thread] = []
        self._info: RankInfo | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> str:
        """Register this rank's KV with the transport, open the side channel; returns its address.

        Raises ``BackendError`` (nothing left open) when either fails.
        """
        if self._context is not None:
            raise UsageError("the producer is already started")
        self._transport.register(self.spec.regions)
        self._context = zmq.Context()
        try:
            port = listen_port(self._config, self.spec.tp_rank)
            self._server = SideChannelServer(self._context, self._config.host, port, self._handle)
        except BackendError:
            self._transport.unregister(self.spec.regions)
            self._context.term()
            raise
        self._info = rank_info(self.spec, self._transport.address, self._server.address)
        client = SideChannelClient(
            self._context, self._config.handshake_timeout_s, self._config.handshake_retries
        )
        self._threads = [
            threading.Thread(target=self._work, name="kvcore-pd-producer", daemon=True),
            threading.Thread(target=self._notify, args=(client,), name="kvcore-pd-notifier", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self._server.address

    @property
    def address(self) -> str:
        """This rank's side-channel address (``tcp://host:port``): what consumers handshake with."""
        if self._server is None:
            raise UsageError("the producer is not started")
        return self._server.address

    def close(self, timeout: float = 2.0) -> None:
        """Stop the side channel and the threads, unregister the KV memory. Idempotent.

        Held transfers are dropped without being reported; a write in flight is awaited for at most
        ``timeout`` first, so that no freed memory is still being read.
        """
        if self._stop.is_set() or self._context is None:
            return
        self._stop.set()
        if self._server is not None:
            self._server.close()
        self._notices.put(None)
        for thread in self._threads:
            thread.join(timeout)
        with self._lock:
            pending = list(self._jobs)
        if pending:
            try:
                self._transport.wait(pending, timeout)
            except KVCoreError as exc:
                log.warning("producer closing with writes still in flight: %s", exc)
        self._transport.unregister(self.spec.regions)
        self._context.term()

    # -- the engine's calls ------------------------------------------------------------------------------

    def offer(self, transfer_id: str, blocks: Sequence[int]) -> None:
        """Hold ``blocks`` for ``transfer_id`` until consumers took them (or the abort timeout).

        Pulls that arrived earlier start now. Raises ``InvalidSpecError`` for a block outside the layout
        or a transfer id already held or finished.
        """
        bad = [b for b in blocks if not 0 <= b < self.spec.layout.num_blocks]
        if bad:
            raise InvalidSpecError(
                f"offer {transfer_id}: block {bad[0]} is outside [0, {self.spec.layout.num_blocks})"
            )
        with self._lock:
            if transfer_id in self._offers or transfer_id in self._finished:
                raise InvalidSpecError(f"offer: transfer {transfer_id!r} is already known here")
            offer = _Offer(tuple(blocks), self._clock() + self._config.abort_timeout_s)
            self._offers[transfer_id] = offer
            for request, _ in self._parked.pop(transfer_id, []):
                self._take(transfer_id, offer, request)

    def abort(self, transfer_id: str) -> None:
        """Stop serving ``transfer_id``: later pulls are refused; the blocks are freed as soon as no write
        reads them. Unknown or finished ids are ignored."""
        with self._lock:
            offer = self._offers.get(transfer_id)
            if offer is not None:
                offer.aborted = True
                self._free_if_done(transfer_id, offer)
            for request, _ in self._parked.pop(transfer_id, []):
                self._fail_parked(transfer_id, request, "the producer aborted the transfer")

    def poll_freed(self) -> tuple[FreedTransfer, ...]:
        """Transfers whose blocks were freed since the last call, each reported once."""
        with self._lock:
            freed, self._freed = tuple(self._freed), []
            return freed

    def held(self) -> int:
        """How many transfers hold blocks now."""
        with self._lock:
            return len(self._offers)

    def waiting(self) -> int:
        """How many pulls and releases arrived before their transfer's offer and wait for it."""
        with self._lock:
            return sum(len(parked) for parked in self._parked.values())

    # -- side channel ------------------------------------------------------------------------------------

    def _handle(self, request: Request) -> Reply:
        if isinstance(request, Hello):
            return self._hello(request.info)
        if isinstance(request, Notice):
            return Refused("a producer takes no notices")
        with self._lock:
            if (request.engine_id, request.tp_rank) not in self._consumers:
                return Refused(f"no handshake from {request.engine_id} rank {request.tp_rank}")
            reason = self._finished.get(request.transfer_id)
            if reason is not None:
                if isinstance(request, Release):
                    return Ack()
                return Refused(f"transfer {request.transfer_id!r} already ended here ({reason.value})")
            offer = self._offers.get(request.transfer_id)
            if offer is None:
                deadline = self._clock() + self._config.abort_timeout_s
                self._parked.setdefault(request.transfer_id, []).append((request, deadline))
                return Ack()
            return self._take(request.transfer_id, offer, request)

    def _hello(self, info: RankInfo) -> Reply:
        if self._info is None:
            return Refused("the producer is not started")
        plan = check_pair(self.spec, info)  # IncompatibleLayoutError -> Refused by the server
        with self._lock:
            self._consumers[(info.engine_id, info.tp_rank)] = _Consumer(info, plan)
        return Welcome(self._info)

    def _take(self, transfer_id: str, offer: _Offer, request: Pull | Release) -> Reply:
        """Account a release or start a pull (under the lock). Refusals leave the offer as it was."""
        consumer = self._consumers[(request.engine_id, request.tp_rank)]
        rank, tp = request.tp_rank, consumer.info.tp_size
        if offer.aborted:
            return Refused(f"transfer {transfer_id!r} was aborted by the producer")
        if offer.expected not in (None, tp):
            return Refused(
                f"transfer {transfer_id!r} is pulled by a TP {offer.expected} consumer, not TP {tp}"
            )
        offer.expected = tp
        if isinstance(request, Release):
            offer.accounted.add(rank)
            self._free_if_done(transfer_id, offer)
            return Ack()
        if rank in offer.pulled:
            return Ack()  # a retried pull
        write = self._plan(transfer_id, offer, consumer, request)
        if isinstance(write, Refused):
            return write
        offer.pulled.add(rank)
        if len(write.lengths):
            offer.writes += 1
            self._writes.put(write)
        else:
            self._notices.put(_Send(transfer_id, consumer, True, ""))
        return Ack()

    def _plan(self, transfer_id: str, offer: _Offer, consumer: _Consumer, pull: Pull) -> _Write | Refused:
        pairs = [
            p for p in consumer.plan.pairs_for_producer(self.spec.tp_rank) if p.consumer_rank == pull.tp_rank
        ]
        if not pairs:
            return Refused(
                f"consumer rank {pull.tp_rank} reads nothing from producer rank {self.spec.tp_rank}"
            )
        missing = set(pull.src_blocks) - offer.blocks
        if missing:
            return Refused(f"blocks {sorted(missing)[:8]} are not part of transfer {transfer_id!r}")
        try:
            columns = consumer.plan.materialize_columns(pairs[0], pull.src_blocks, pull.dst_blocks)
        except InvalidSpecError as exc:
            return Refused(f"pull for {transfer_id!r}: {exc}")
        src_bases = np.asarray(self.spec.layer_bases, dtype=np.int64)[:, None]
        dst_bases = np.asarray(consumer.info.layer_bases, dtype=np.int64)[:, None]
        lengths = np.asarray(columns.lengths, dtype=np.int64)
        return _Write(
            transfer_id,
            consumer,
            (src_bases + np.asarray(columns.src_offsets, dtype=np.int64)).ravel(),
            (dst_bases + np.asarray(columns.dst_offsets, dtype=np.int64)).ravel(),
            np.tile(lengths, len(self.spec.layer_bases)),
        )

    # -- worker ------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                write = self._writes.get(timeout=_TICK_S)
            except queue.Empty:
                pass
            else:
                self._submit(write)
            for result in self._transport.poll():
                self._written(result)
            self._expire()

    def _submit(self, write: _Write) -> None:
        try:
            job = self._transport.submit_write_columns(
                write.consumer.info.rpc_address, write.srcs, write.dsts, write.lengths
            )
        except KVCoreError as exc:
            self._written_as(write, False, f"write could not start: {exc}")
            return
        with self._lock:
            self._jobs[job] = write

    def _written(self, result: JobResult) -> None:
        with self._lock:
            write = self._jobs.pop(result.job_id, None)
        if write is not None:
            self._written_as(write, result.ok, result.error or "")

    def _written_as(self, write: _Write, ok: bool, reason: str) -> None:
        if not ok:
            log.warning(
                "transfer %s to %s failed: %s", write.transfer_id, write.consumer.info.rpc_address, reason
            )
        with self._lock:
            offer = self._offers.get(write.transfer_id)
            if offer is not None:
                offer.writes -= 1
                self._free_if_done(write.transfer_id, offer)
        self._notices.put(_Send(write.transfer_id, write.consumer, ok, reason))

    def _expire(self) -> None:
        now = self._clock()
        with self._lock:
            for transfer_id, offer in list(self._offers.items()):
                if offer.deadline <= now:
                    self._free_if_done(transfer_id, offer)
            for transfer_id, parked in list(self._parked.items()):
                late = [request for request, deadline in parked if deadline <= now]
                if late:
                    self._parked[transfer_id] = [(r, d) for r, d in parked if d > now]
                    if not self._parked[transfer_id]:
                        del self._parked[transfer_id]
                for request in late:
                    self._fail_parked(transfer_id, request, "the producer never offered this transfer")

    def _fail_parked(self, transfer_id: str, request: Pull | Release, reason: str) -> None:
        consumer = self._consumers.get((request.engine_id, request.tp_rank))
        if isinstance(request, Pull) and consumer is not None:
            self._notices.put(_Send(transfer_id, consumer, False, reason))

    def _free_if_done(self, transfer_id: str, offer: _Offer) -> None:
        """Free the offer's blocks if nothing reads them and nobody waits for them (under the lock)."""
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
                self._config.abort_timeout_s,
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

    # -- notifier ----------------------------------------------------------------------------------------

    def _notify(self, client: SideChannelClient) -> None:
        try:
            while (send := self._notices.get()) is not None:
                self._deliver(client, send)
        finally:
            client.close()

    def _deliver(self, client: SideChannelClient, send: _Send) -> None:
        info = send.consumer.info
        notice = Notice(send.transfer_id, self.spec.engine_id, self.spec.tp_rank, send.ok, send.reason)
        try:
            reply = client.request(info.side_channel, notice)
        except BackendError as exc:
            log.warning(
                "transfer %s: consumer %s rank %d unreachable: %s",
                send.transfer_id,
                info.engine_id,
                info.tp_rank,
                exc,
            )
            return
        if isinstance(reply, Refused):
            log.warning(
                "transfer %s: consumer rank %d refused the notice: %s",
                send.transfer_id,
                info.tp_rank,
                reply.reason,
            )
        with self._lock:
            offer = self._offers.get(send.transfer_id)
            if offer is not None:
                offer.accounted.add(info.tp_rank)
                self._free_if_done(send.transfer_id, offer)
