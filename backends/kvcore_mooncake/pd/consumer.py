"""``PDConsumer``: the decode side of one rank. It asks producer ranks for KV and learns when it arrived.

``receive`` names a transfer, the producer ranks' side-channel addresses (rank order), the producer's
block ids and this rank's block ids; producers write into this rank's KV, registered with its
``PeerTransport``. A worker thread handshakes with every producer rank (cached per address; refused on
any incompatibility before a byte moves), sends a ``Pull`` to each producer rank that holds heads this
rank needs and a ``Release`` to the others, then waits for the producers' ``Notice``s on the side
channel. ``poll`` reports each transfer exactly once: received when every needed producer rank
said done; failed -- with every destination block listed for recompute -- when one refused, failed, could
not be reached, or stayed silent past ``abort_timeout_s`` (by then the producer has freed its blocks, so
nothing more can come), or when the engine aborted it. Duplicate or late notices are acknowledged and
ignored.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from attrs import frozen

from kvcore.config import PDConfig
from kvcore.errors import BackendError, IncompatibleLayoutError, InvalidSpecError, KVCoreError, UsageError
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
from kvcore_mooncake.pd.side_channel import SideChannelClient
from kvcore_mooncake.pd.spec import RankSpec

__all__ = ["PDConsumer", "ReceivedTransfer"]

log = logging.getLogger(__name__)

_TICK_S = 0.005  # the worker's longest sleep: how late a deadline is noticed


@frozen
class ReceivedTransfer:
    """How one ``receive`` ended. ``failed_blocks`` (this rank's block ids) hold undefined bytes."""

    transfer_id: str
    ok: bool
    failed_blocks: tuple[int, ...] = ()
    error: str | None = None


@frozen(eq=False)
class _Producer:
    info: RankInfo
    plan: PairPlan


@frozen(eq=False)
class _Ask:
    transfer_id: str
    addresses: tuple[str, ...]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    state_src_blocks: tuple[int, ...]
    state_dst_blocks: tuple[int, ...]


@frozen(eq=False)
class _Release:
    transfer_id: str
    addresses: tuple[str, ...]


class _Receiving:
    """A transfer being received (guarded by the consumer's lock)."""

    __slots__ = ("addresses", "deadline", "done", "dst_blocks", "needed")

    def __init__(self, addresses: tuple[str, ...], dst_blocks: tuple[int, ...], deadline: float) -> None:
        self.addresses = addresses
        self.dst_blocks = dst_blocks
        self.deadline = deadline
        self.needed: frozenset[int] | None = None  # producer ranks that write here, once planned
        self.done: set[int] = set()


class PDConsumer:
    """One consumer rank: its side channel, its transfers in progress. Call ``start`` first."""

    def __init__(
        self,
        spec: RankSpec,
        transport: PeerTransport,
        config: PDConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self._endpoint = Endpoint("consumer", spec, transport, config)
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._producers: dict[str, _Producer] = {}
        self._receiving: dict[str, _Receiving] = {}
        self._results: list[ReceivedTransfer] = []
        self._work_queue: queue.SimpleQueue[_Ask | _Release | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> str:
        """Register this rank's KV with the transport (peers write into it), open the side channel.

        Returns the side-channel address. Raises ``BackendError`` (nothing left open) when either fails,
        ``UsageError`` when started before.
        """
        address = self._endpoint.start(self._handle)
        self._thread = threading.Thread(
            target=self._work, args=(self._endpoint.client(),), name="kvcore-pd-consumer", daemon=True
        )
        self._thread.start()
        return address

    @property
    def address(self) -> str:
        """This rank's side-channel address (``tcp://host:port``), announced in its handshakes."""
        return self._endpoint.address

    def close(self, timeout: float = 2.0) -> None:
        """Stop the side channel and the worker, report open transfers failed, unregister the KV memory.

        Idempotent. A producer still writing into this rank then fails its write.
        """
        if not self._endpoint.running:
            return
        self._stop.set()
        self._work_queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            for transfer_id in list(self._receiving):
                self._finish(transfer_id, "the consumer closed")
        self._endpoint.close()

    # -- the engine's calls ------------------------------------------------------------------------------

    def connect(self, producer_addresses: Sequence[str]) -> None:
        """Handshake with every producer rank now (otherwise the first ``receive`` does it).

        Raises ``IncompatibleLayoutError`` naming every difference when the two engines cannot exchange
        KV, ``BackendUnavailable`` when a rank does not answer within the retries.
        """
        client = self._endpoint.client()
        try:
            self._producers_of(client, tuple(producer_addresses))
        finally:
            client.close()

    def receive(
        self,
        transfer_id: str,
        producer_addresses: Sequence[str],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        state_src_blocks: Sequence[int] = (),
        state_dst_blocks: Sequence[int] = (),
    ) -> None:
        """Start receiving producer blocks ``src_blocks[i]`` into this rank's ``dst_blocks[i]``, and the
        recurrent states of ``state_src_blocks[i]`` into ``state_dst_blocks[i]`` (a hybrid SSM model's
        blocks of its state groups).

        Returns at once; the outcome comes once through ``poll``. Raises ``InvalidSpecError`` (nothing
        sent) for lists of different lengths, a block outside the layout or named twice, or a transfer
        id already being received; ``UsageError`` before ``start``.
        """
        dst, src = tuple(dst_blocks), tuple(src_blocks)
        state_dst, state_src = tuple(state_dst_blocks), tuple(state_src_blocks)
        if len(src) != len(dst) or len(state_src) != len(state_dst):
            raise InvalidSpecError(
                f"receive {transfer_id}: {len(src)} source blocks, {len(dst)} destination blocks, "
                f"{len(state_src)} state source blocks, {len(state_dst)} state destination blocks"
            )
        written = dst + state_dst
        if any(not 0 <= b < self.spec.layout.num_blocks for b in written) or len(set(written)) != len(
            written
        ):
            raise InvalidSpecError(
                f"receive {transfer_id}: destination blocks must be distinct and in "
                f"[0, {self.spec.layout.num_blocks})"
            )
        if state_dst and self.spec.state is None:
            raise InvalidSpecError(f"receive {transfer_id}: state blocks for a model without states")
        if not producer_addresses:
            raise InvalidSpecError(f"receive {transfer_id}: no producer addresses")
        if not self._endpoint.running:
            raise UsageError("the consumer is not running")
        addresses = tuple(producer_addresses)
        with self._lock:
            if transfer_id in self._receiving:
                raise InvalidSpecError(f"receive: transfer {transfer_id!r} is already being received")
            deadline = self._clock() + self._config.abort_timeout_s
            self._receiving[transfer_id] = _Receiving(addresses, written, deadline)
        self._work_queue.put(_Ask(transfer_id, addresses, src, dst, state_src, state_dst))

    def abort(self, transfer_id: str) -> None:
        """Give up on a transfer: it is reported failed (once) and its producers are released.

        Unknown or finished ids are ignored.
        """
        with self._lock:
            state = self._receiving.get(transfer_id)
            if state is None:
                return
            self._finish(transfer_id, "aborted by the consumer")
        self._work_queue.put(_Release(transfer_id, state.addresses))

    def poll(self) -> tuple[ReceivedTransfer, ...]:
        """Transfers that ended since the last call, each reported once."""
        with self._lock:
            results, self._results = tuple(self._results), []
            return results

    # -- side channel ------------------------------------------------------------------------------------

    def _handle(self, request: Request) -> Reply:
        if not isinstance(request, Notice):
            return Refused(f"a consumer takes only notices, not {type(request).__name__}")
        with self._lock:
            state = self._receiving.get(request.transfer_id)
            if state is None or state.needed is None or request.tp_rank not in state.needed:
                return Ack()  # late, duplicate or stray: acknowledged so the producer can free
            if not request.ok:
                self._finish(request.transfer_id, f"producer rank {request.tp_rank}: {request.reason}")
            else:
                state.done.add(request.tp_rank)
                if state.done >= state.needed:
                    self._finish(request.transfer_id, None)
        return Ack()

    def _finish(self, transfer_id: str, error: str | None) -> None:
        """Report a transfer's end (under the lock); later notices for it are ignored."""
        state = self._receiving.pop(transfer_id)
        if error is None:
            self._results.append(ReceivedTransfer(transfer_id, True))
        else:
            log.warning("transfer %s failed on consumer rank %d: %s", transfer_id, self.spec.tp_rank, error)
            self._results.append(ReceivedTransfer(transfer_id, False, state.dst_blocks, error))

    # -- worker ------------------------------------------------------------------------------------------

    def _work(self, client: SideChannelClient) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = self._work_queue.get(timeout=_TICK_S)
                except queue.Empty:
                    item = None
                if isinstance(item, _Ask):
                    self._ask(client, item)
                elif isinstance(item, _Release):
                    self._release(client, item.transfer_id, item.addresses, range(len(item.addresses)))
                self._expire(client)
        finally:
            client.close()

    def _ask(self, client: SideChannelClient, ask: _Ask) -> None:
        asked: list[int] = []
        try:
            producers = self._producers_of(client, ask.addresses)
            needed = producers[0].plan.producers_for(
                self.spec.tp_rank, kv=bool(ask.dst_blocks), state=bool(ask.state_dst_blocks)
            )
            with self._lock:
                state = self._receiving.get(ask.transfer_id)
                if state is None:
                    return  # aborted meanwhile: the abort releases the producers
                state.needed = needed
            for rank, producer in enumerate(producers):
                message: Pull | Release = (
                    Pull(
                        ask.transfer_id,
                        self.spec.engine_id,
                        self.spec.tp_rank,
                        ask.src_blocks,
                        ask.dst_blocks,
                        ask.state_src_blocks,
                        ask.state_dst_blocks,
                    )
                    if rank in needed
                    else Release(ask.transfer_id, self.spec.engine_id, self.spec.tp_rank)
                )
                reply = client.request(producer.info.side_channel, message)
                asked.append(rank)
                if isinstance(reply, Refused):
                    raise BackendError(f"producer rank {rank} refused: {reply.reason}")
        except KVCoreError as exc:
            with self._lock:
                if ask.transfer_id in self._receiving:
                    self._finish(ask.transfer_id, str(exc))
            others = [r for r in range(len(ask.addresses)) if r not in asked]
            self._release(client, ask.transfer_id, ask.addresses, others)
            return
        if not needed:
            with self._lock:
                if ask.transfer_id in self._receiving:
                    self._finish(ask.transfer_id, None)

    def _producers_of(self, client: SideChannelClient, addresses: tuple[str, ...]) -> list[_Producer]:
        producers = [self._handshake(client, address) for address in addresses]
        first = producers[0].info
        for rank, producer in enumerate(producers):
            info = producer.info
            if (info.engine_id, info.tp_size, info.tp_rank) != (first.engine_id, len(addresses), rank):
                raise IncompatibleLayoutError(
                    f"producer address {rank} ({addresses[rank]}) is {info.engine_id} rank {info.tp_rank} of "
                    f"TP {info.tp_size}; expected {first.engine_id} rank {rank} of TP {len(addresses)}"
                )
        return producers

    def _handshake(self, client: SideChannelClient, address: str) -> _Producer:
        with self._lock:
            known = self._producers.get(address)
        if known is not None:
            return known
        mine = self._endpoint.info
        if mine is None:
            raise UsageError("the consumer is not started")
        reply = client.request(address, Hello(mine))
        if isinstance(reply, Refused):
            raise IncompatibleLayoutError(f"producer {address} refused the handshake: {reply.reason}")
        if not isinstance(reply, Welcome):
            raise BackendError(f"producer {address} answered a handshake with {type(reply).__name__}")
        producer = _Producer(reply.info, check_pair(reply.info, self.spec))
        with self._lock:
            self._producers[address] = producer
        return producer

    def _release(
        self, client: SideChannelClient, transfer_id: str, addresses: tuple[str, ...], ranks: Sequence[int]
    ) -> None:
        """Tell producer ranks to stop holding ``transfer_id`` for this rank; best effort, one attempt."""
        for rank in ranks:
            with self._lock:
                producer = self._producers.get(addresses[rank])
            if producer is None:
                continue  # never reached: it holds nothing for us
            try:
                client.request(
                    producer.info.side_channel,
                    Release(transfer_id, self.spec.engine_id, self.spec.tp_rank),
                    retries=0,
                )
            except BackendError as exc:
                log.warning("transfer %s: release to producer rank %d failed: %s", transfer_id, rank, exc)

    def _expire(self, client: SideChannelClient) -> None:
        now = self._clock()
        with self._lock:
            late = [(t, s.addresses) for t, s in self._receiving.items() if s.deadline <= now]
            for transfer_id, _ in late:
                self._finish(transfer_id, f"no completion after {self._config.abort_timeout_s:.1f}s")
        for transfer_id, addresses in late:
            self._release(client, transfer_id, addresses, range(len(addresses)))
