"""The P/D connector's scheduler side (vLLM's engine-core process): which requests send or receive KV.

A prefill request (``do_remote_decode``) that finishes normally keeps its blocks (delayed free) under a
fresh transfer id; the params it returns name the producer's ranks and blocks (``pd_params``). A decode
request (``do_remote_prefill``) asks for every prompt token its local prefix cache does not hold, loaded
asynchronously (vLLM's P/D rule: the whole prompt, vLLM then recomputes the last token); after
allocation its blocks from the first one past the local hit are paired with the producer's blocks at the
same positions. Each decode request gets one transfer; one that ends without pulling anything (aborted
before allocation, or fully held locally) still releases the producer's blocks.
"""

from __future__ import annotations

import enum
import logging
import uuid
from typing import TYPE_CHECKING, Any

from attrs import frozen

from kvcore.config import PDConfig
from kvcore.errors import ConfigError
from kvcore_vllm.pd_metadata import Offer, PDMetadata, Receive
from kvcore_vllm.pd_params import RemotePrefill, wants_remote_decode, wants_remote_prefill

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PDRole", "PDScheduler"]

log = logging.getLogger(__name__)


class PDRole(enum.Enum):
    """vLLM's ``kv_role``: a prefill engine, a decode engine, or both (each request says which)."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @classmethod
    def of(cls, kv_role: object) -> PDRole:
        """vLLM's ``kv_role`` as a P/D role. Raises ``ConfigError`` for one P/D does not play."""
        for role in cls:
            if role.value == kv_role:
                return role
        raise ConfigError("kv_role", kv_role, f"one of {', '.join(repr(r.value) for r in cls)} for P/D")

    @property
    def produces(self) -> bool:
        return self is not PDRole.CONSUMER

    @property
    def consumes(self) -> bool:
        return self is not PDRole.PRODUCER


def producer_addresses(config: PDConfig, tp_size: int) -> tuple[str, ...]:
    """Every producer rank's side channel: rank ``r`` listens on ``config.port + r``.

    Raises ``ConfigError`` for port 0: consumers find the ranks from one published address.
    """
    if config.port == 0:
        raise ConfigError(
            "pd.port", 0, "a fixed side-channel port on a producer (rank r listens on port + r)"
        )
    if config.port + tp_size - 1 > 65535:
        raise ConfigError(
            "pd.port", config.port, f"at most {65536 - tp_size}: ranks 0..{tp_size - 1} listen on port + rank"
        )
    return tuple(f"tcp://{config.host}:{config.port + rank}" for rank in range(tp_size))


@frozen
class _Asked:
    """A decode request's answer from ``get_num_new_matched_tokens``, kept until allocation."""

    source: RemotePrefill
    local_tokens: int


def _blocks(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


class PDScheduler:
    def __init__(
        self, role: PDRole, engine_id: str, block_tokens: int, tp_size: int, config: PDConfig
    ) -> None:
        self.role = role
        self._engine_id = engine_id
        self._block = block_tokens
        self._addresses = producer_addresses(config, tp_size) if role.produces else ()
        self._asked: dict[str, _Asked] = {}
        self._issued: set[str] = set()  # decode requests whose one transfer was issued
        self._receiving: set[str] = set()  # ... and not yet reported finished by the workers
        self._offers: list[Offer] = []
        self._receives: list[Receive] = []

    @property
    def block_tokens(self) -> int:
        return self._block

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        request_id = request.request_id
        if not self.role.consumes or request_id in self._issued or not wants_remote_prefill(params):
            return 0, False
        source = RemotePrefill.from_params(params)
        if source is None:
            self._issued.add(request_id)  # nobody to pull from, nobody to release
            return 0, False
        total = min(source.num_tokens, request.num_prompt_tokens)
        if num_computed_tokens % self._block or _blocks(total, self._block) > len(source.block_ids):
            log.warning(
                "kvcore P/D: request %s: %d producer blocks cannot hold %d tokens past a local hit of %d; "
                "computing the prompt",
                request_id,
                len(source.block_ids),
                total,
                num_computed_tokens,
            )
            total = num_computed_tokens
        self._asked[request_id] = _Asked(source, num_computed_tokens)
        count = total - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        asked = self._asked.pop(request.request_id, None)
        if asked is None:
            return
        self._issued.add(request.request_id)
        source = asked.source
        first = asked.local_tokens // self._block
        last = (
            _blocks(asked.local_tokens + num_external_tokens, self._block) if num_external_tokens else first
        )
        src, dst = source.block_ids[first:last], blocks.get_block_ids()[0][first:last]
        self._receives.append(Receive(request.request_id, source.transfer_id, source.addresses, src, dst))
        if num_external_tokens:
            self._receiving.add(request.request_id)

    def build_connector_meta(self) -> PDMetadata:
        meta = PDMetadata(tuple(self._offers), tuple(self._receives))
        self._offers.clear()
        self._receives.clear()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._receiving.difference_update(connector_output.finished_recving or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free of a prefill to be sent (returning its params) or of a decode still receiving."""
        from vllm.v1.request import RequestStatus

        request_id = request.request_id
        params = request.kv_transfer_params
        self._asked.pop(request_id, None)
        if request_id in self._issued:
            self._issued.discard(request_id)
            # A producer may still write into these blocks: they are freed when the workers report the
            # transfer ended (finished receiving), whether it succeeded or not.
            return request_id in self._receiving, None
        if self.role.consumes and wants_remote_prefill(params):
            source = RemotePrefill.from_params(params)
            if source is not None:  # finished before allocation: let the producer free its blocks now
                self._receives.append(Receive(request_id, source.transfer_id, source.addresses, (), ()))
            return False, None
        finished = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not (self.role.produces and wants_remote_decode(params) and finished and block_ids):
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        held = tuple(block_ids[: _blocks(num_tokens, self._block)])
        transfer_id = uuid.uuid4().hex
        self._offers.append(Offer(request_id, transfer_id, held))
        source = RemotePrefill(transfer_id, self._engine_id, self._addresses, held, num_tokens)
        return True, source.to_params()
