"""``PDProducer``: the prefill side of one rank. It keeps finished prefills' blocks and pushes them.

The engine ``offer``s a finished request's blocks under a transfer id. Each consumer rank handshakes
(``Hello``), then asks for the blocks it needs (``Pull``: producer block ids and its own block ids) or says
it needs none from this rank (``Release``). For a pull the producer plans the byte ranges with the core's
transfer plan, writes them into the consumer's registered blocks through any ``PeerTransport``, and sends
the consumer a ``Notice`` (done or failed); the consumer's answer is its acknowledgement. When blocks are
freed, and what a request gets, is the ``OfferBook``'s rule (``offers``); this module runs it.

Threads: the side channel answers requests; a worker submits writes, collects their results and runs
deadlines; a notifier delivers notices, so that a dead consumer delays no other transfer's writes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
from attrs import frozen

from kvcore.config import PDConfig
from kvcore.errors import BackendError, InvalidSpecError, KVCoreError
from kvcore.ids import JobId
from kvcore.jobs import JobResult
from kvcore.ports import PeerTransport
from kvcore_mooncake.pd.endpoint import Endpoint
from kvcore_mooncake.pd.handshake import PairPlan, check_pair
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
from kvcore_mooncake.pd.offers import FreedTransfer, OfferBook
from kvcore_mooncake.pd.side_channel import SideChannelClient
from kvcore_mooncake.pd.spec import RankSpec

__all__ = ["PDProducer"]

log = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]

_TICK_S = 0.002  # the worker's longest sleep: how late a finished write is noticed


@frozen(eq=False)
class _Consumer:
    info: RankInfo
    plan: PairPlan


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
        transport: PeerTransport,
        config: PDConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self._transport = transport
        self._endpoint = Endpoint("producer", spec, transport, config)
        self._lock = threading.Lock()
        self._book = OfferBook(config.abort_timeout_s, clock)
        self._consumers: dict[tuple[str, int], _Consumer] = {}
        self._jobs: dict[JobId, _Write] = {}
        self._writes: queue.SimpleQueue[_Write] = queue.SimpleQueue()
        self._notices: queue.SimpleQueue[_Send | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> str:
        """Register this rank's KV with the transport, open the side channel; returns its address.

        Raises ``BackendError`` (nothing left open) when either fails, ``UsageError`` when started before.
        """
        address = self._endpoint.start(self._handle)
        client = self._endpoint.client()
        self._threads = [
            threading.Thread(target=self._work, name="kvcore-pd-producer", daemon=True),
            threading.Thread(target=self._notify, args=(client,), name="kvcore-pd-notifier", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return address

    @property
    def address(self) -> str:
        """This rank's side-channel address (``tcp://host:port``): what consumers handshake with."""
        return self._endpoint.address

    def close(self, timeout: float = 2.0) -> None:
        """Stop the side channel and the threads, unregister the KV memory. Idempotent.

        Held transfers are dropped without being reported; a write in flight is awaited for at most
        ``timeout`` first, so that no freed memory is still being read.
        """
        if not self._endpoint.running:
            return
        self._stop.set()
        self._endpoint.stop_serving()
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
        self._endpoint.close()

    # -- the engine's calls ------------------------------------------------------------------------------

    def offer(self, transfer_id: str, blocks: Sequence[int]) -> None:
        """Hold ``blocks`` for ``transfer_id`` until consumers took them (or the abort timeout).

        Requests that arrived earlier are taken now (a pull refused then gets a failed notice). Raises
        ``InvalidSpecError`` for a block outside the layout or a transfer id already held or finished.
        """
        bad = [b for b in blocks if not 0 <= b < self.spec.layout.num_blocks]
        if bad:
            raise InvalidSpecError(
                f"offer {transfer_id}: block {bad[0]} is outside [0, {self.spec.layout.num_blocks})"
            )
        with self._lock:
            for request in self._book.offer(transfer_id, blocks):
                reply = self._admit(self._consumers[(request.engine_id, request.tp_rank)], request)
                if isinstance(reply, Refused):
                    self._fail(request, reply.reason)

    def abort(self, transfer_id: str) -> None:
        """Stop serving ``transfer_id``: later pulls are refused; the blocks are freed as soon as no write
        reads them. Unknown or finished ids are ignored."""
        with self._lock:
            for request in self._book.abort(transfer_id):
                self._fail(request, "the producer aborted the transfer")

    def poll_freed(self) -> tuple[FreedTransfer, ...]:
        """Transfers whose blocks were freed since the last call, each reported once."""
        with self._lock:
            return self._book.poll_freed()

    def held(self) -> int:
        """How many transfers hold blocks now."""
        with self._lock:
            return self._book.held()

    def waiting(self) -> int:
        """How many pulls and releases arrived before their transfer's offer and wait for it."""
        with self._lock:
            return self._book.waiting()

    # -- side channel ------------------------------------------------------------------------------------

    def _handle(self, request: Request) -> Reply:
        if isinstance(request, Hello):
            return self._hello(request.info)
        if isinstance(request, Notice):
            return Refused("a producer takes no notices")
        with self._lock:
            consumer = self._consumers.get((request.engine_id, request.tp_rank))
            if consumer is None:
                return Refused(f"no handshake from {request.engine_id} rank {request.tp_rank}")
            return self._admit(consumer, request)

    def _hello(self, info: RankInfo) -> Reply:
        mine = self._endpoint.info
        if mine is None:
            return Refused("the producer is not started")
        plan = check_pair(self.spec, info)  # IncompatibleLayoutError -> Refused by the server
        with self._lock:
            self._consumers[(info.engine_id, info.tp_rank)] = _Consumer(info, plan)
        return Welcome(mine)

    def _admit(self, consumer: _Consumer, request: Pull | Release) -> Reply:
        """Answer a release or pull (under the lock); start a new pull's write. Refusals change nothing."""
        verdict = self._book.admit(request, consumer.info.tp_size)
        if not isinstance(verdict, Pull):
            return verdict
        write = self._plan(consumer, verdict)
        if isinstance(write, Refused):
            return write
        self._book.pulled(verdict, writes=bool(len(write.lengths)))
        if len(write.lengths):
            self._writes.put(write)
        else:
            self._notices.put(_Send(verdict.transfer_id, consumer, True, ""))
        return Ack()

    def _plan(self, consumer: _Consumer, pull: Pull) -> _Write | Refused:
        try:
            columns = consumer.plan.columns(self.spec.tp_rank, pull)
        except InvalidSpecError as exc:
            return Refused(f"pull for {pull.transfer_id!r}: {exc}")
        if columns is None:
            return Refused(
                f"consumer rank {pull.tp_rank} reads nothing from producer rank {self.spec.tp_rank}"
            )
        src_bases = np.asarray(self.spec.layer_bases, dtype=np.int64)[:, None]
        dst_bases = np.asarray(consumer.info.layer_bases, dtype=np.int64)[:, None]
        lengths = np.asarray(columns.lengths, dtype=np.int64)
        return _Write(
            pull.transfer_id,
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
            with self._lock:
                for request in self._book.expire():
                    self._fail(request, "the producer never offered this transfer")

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
            self._book.write_ended(write.transfer_id)
        self._notices.put(_Send(write.transfer_id, write.consumer, ok, reason))

    def _fail(self, request: Pull | Release, reason: str) -> None:
        """Tell a consumer rank that its parked pull will never be served (under the lock)."""
        consumer = self._consumers.get((request.engine_id, request.tp_rank))
        if isinstance(request, Pull) and consumer is not None:
            self._notices.put(_Send(request.transfer_id, consumer, False, reason))

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
            self._book.delivered(send.transfer_id, info.tp_rank)
