"""The P/D connector's worker side (one per TP rank): Mooncake's producer and consumer on this rank's KV.

The composition root of P/D on a worker: it checks vLLM's KV tensors against the declared layout, builds
the rank's ``RankSpec`` and starts a ``PDProducer`` and/or a ``PDConsumer``, each on its own transfer
engine (a ``kv_both`` rank registers its KV once per engine). Each step it hands the scheduler's offers
and receives to them and turns their completions into vLLM's request ids: freed offers are "finished
sending", ended receives "finished receiving", failed receives' blocks are load errors (recomputed),
and their requests are failed loads (how vLLM takes them for a model of several KV-cache groups).
A transfer the backend refuses ends at once the same way; nothing here raises into vLLM after start-up.

The layers of a hybrid model's KV-cache groups share vLLM's KV tensors (a block belongs to one group at a
time): the rank registers and moves one view per tensor, so a block moves whichever group holds it (a
hybrid SSM model's pages, ``kv_layout.page_views``, hold K and V or a recurrent state, each moved by its own
plan: ``RankSpec.state``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import attrs
import torch

from kvcore.config import PDConfig
from kvcore.errors import InvalidSpecError, KVCoreError
from kvcore.model.layout import LayoutKind
from kvcore.ports import PeerTransport
from kvcore_cpu.amx import claim_amx
from kvcore_cpu.engine_kv import EngineKV
from kvcore_mooncake.pd import MooncakePeerTransport, PDConsumer, PDProducer, RankSpec
from kvcore_vllm.engine_spec import PDEngine
from kvcore_vllm.kv_layout import connector_views, page_views
from kvcore_vllm.pd_metadata import Offer, PDMetadata, Receive
from kvcore_vllm.pd_scheduler import PDRole

__all__ = ["PDWorker"]

log = logging.getLogger(__name__)


class PDWorker:
    def __init__(self, role: PDRole, moved: PDEngine, config: PDConfig, engine_id: str, rank: int) -> None:
        self.role = role
        self._moved = moved
        self._engine = moved.engine
        self._config = config
        self._engine_id = engine_id
        self._layers = moved.layers
        self._rank = rank
        self._transports: list[PeerTransport] = []
        self.producer: PDProducer | None = None
        self.consumer: PDConsumer | None = None
        self._sending: dict[str, str] = {}  # transfer id -> request id, offered and not yet freed
        self._receiving: dict[str, Receive] = {}  # by transfer id, until its result came
        self.pulled_blocks = 0  # blocks received whole from producers: what a test or benchmark counts
        self._sent_now: set[str] = set()
        self._received_now: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Start this rank's producer and/or consumer on vLLM's KV tensors.

        Raises ``InvalidSpecError`` for tensors that do not match the layout, ``BackendError`` when a
        transfer engine or side channel does not start (what was started is closed again).
        """
        if self._engine.layout.kind is LayoutKind.STATE:  # a hybrid SSM model: its pages registered whole
            tensors = page_views(kv_caches, self._layers, self._engine)
        else:
            views = connector_views(kv_caches, self._layers, self._engine)
            tensors = list({view.data_ptr(): view for view in views}.values())  # one per shared tensor
        EngineKV.register(
            tensors, self._engine.layout, kv_dtype=self._engine.kv_dtype
        )  # refuses tensors that differ from the layout
        kv = self._moved.kv
        spec = RankSpec(
            engine_id=self._engine_id,
            model=kv.model_id,
            dtype=kv.kv_dtype,
            tp_size=kv.tp_size,
            tp_rank=self._rank,
            total_kv_heads=kv.total_kv_heads,
            layout=kv.layout,
            layer_bases=tuple(t.data_ptr() for t in tensors),
            state=self._moved.state,
        )
        claim_amx()  # before the transfer engines start their threads
        try:
            if self.role.produces:
                self.producer = PDProducer(spec, self._transport(), self._config)
                log.info("kvcore P/D: producer rank %d listens on %s", self._rank, self.producer.start())
            if self.role.consumes:
                # A consumer announces its address in the handshake: on a kv_both rank it leaves the
                # configured port to the producer.
                config = attrs.evolve(self._config, port=0) if self.role.produces else self._config
                self.consumer = PDConsumer(spec, self._transport(), config)
                log.info("kvcore P/D: consumer rank %d listens on %s", self._rank, self.consumer.start())
        except KVCoreError:
            self.shutdown()
            raise

    def _transport(self) -> PeerTransport:
        transport = MooncakePeerTransport.open(self._config)
        self._transports.append(transport)
        return transport

    def start_load_kv(self, meta: PDMetadata) -> None:
        for offer in meta.offers:
            self._offer(offer)
        for receive in meta.receives:
            self._receive(receive)

    def _offer(self, offer: Offer) -> None:
        if self.producer is None:
            raise InvalidSpecError("an offer reached a rank without a producer")
        try:
            self.producer.offer(offer.transfer_id, offer.blocks)
        except InvalidSpecError as exc:
            log.warning("kvcore P/D: request %s cannot be offered, freeing it: %s", offer.request_id, exc)
            self._sent_now.add(offer.request_id)
            return
        self._sending[offer.transfer_id] = offer.request_id

    def _receive(self, receive: Receive) -> None:
        if self.consumer is None:
            raise InvalidSpecError("a receive reached a rank without a consumer")
        try:
            self.consumer.receive(
                receive.transfer_id,
                receive.addresses,
                receive.src_blocks,
                receive.dst_blocks,
                receive.state_src_blocks,
                receive.state_dst_blocks,
            )
        except InvalidSpecError as exc:
            log.warning("kvcore P/D: request %s cannot be received: %s", receive.request_id, exc)
            if not receive.is_release:
                self._ended(receive, receive.written)
            return
        if receive.written:
            self._receiving[receive.transfer_id] = receive
        elif receive.missing:
            self._ended(receive, ())  # nothing to pull: the producer was only told to free its blocks

    def _ended(self, receive: Receive, failed_blocks: Sequence[int]) -> None:
        """``receive``'s pull ended with ``failed_blocks`` unwritten (its ``missing`` blocks are too)."""
        failed = {*failed_blocks, *receive.missing}
        self._received_now.add(receive.request_id)
        self._load_errors.update(failed)
        if failed:
            self._failed.add(receive.request_id)
        self.pulled_blocks += len(set(receive.written) - failed)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose blocks this rank no longer reads (sent) and whose receive ended (received)."""
        sent, self._sent_now = self._sent_now, set()
        if self.producer is not None:
            for freed in self.producer.poll_freed():
                request_id = self._sending.pop(freed.transfer_id, None)
                if request_id is not None:
                    sent.add(request_id)
        if self.consumer is not None:
            for result in self.consumer.poll():
                if result.transfer_id not in self._receiving:
                    continue
                self._ended(self._receiving.pop(result.transfer_id), result.failed_blocks)
        received, self._received_now = self._received_now, set()
        return sent or None, received or None

    def take_load_errors(self) -> set[int]:
        """Blocks whose receive failed since the last call: vLLM recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed(self) -> set[str]:
        """Requests whose receive failed, in any block, since the last call (vLLM recomputes them whole:
        how it takes a failed load of a model of several KV-cache groups)."""
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        """Stop the producer, the consumer and their transfer engines. Idempotent."""
        for side in (self.producer, self.consumer):
            if side is not None:
                side.close()
        for transport in self._transports:
            transport.close()
        self._transports.clear()
