"""The P/D connector's scheduler side (vLLM's engine-core process): which requests send or receive KV.

A prefill request (``do_remote_decode``) that finishes normally keeps its blocks (delayed free) under a
fresh transfer id; the params it returns name the producer's ranks and blocks (``pd_params``). A decode
request (``do_remote_prefill``) asks for every prompt token its local prefix cache does not hold, loaded
asynchronously (vLLM's P/D rule: the whole prompt, vLLM then recomputes the last token); after allocation
its blocks from the first one past the local hit are paired with the producer's blocks at the same
positions, in every KV-cache group (a hybrid model's groups each have a block table: a pair where this
engine holds vLLM's null block moves nothing, as a sliding window's blocks before it; where the producer
gave back a block this engine needs, nothing is pulled and the request is recomputed). With a sliding
window or Mamba states both sides stop one token short of the prompt (``stops_short``): the decode engine
computes the last token with its whole window (asked for the whole prompt, vLLM would null the block of
the window's oldest key) or from the state before it, so the prefill engine computes every prompt token
but that one (``on_new_request`` drops it, as vLLM's NIXL connector does), gives back exactly the blocks
the decode engine does not hold, and keeps the state it needs; a producer that did not stop short is not
pulled from. Each decode request gets one transfer; one that ends without pulling anything (aborted before
allocation, or fully held locally) still releases the producer's blocks.
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
from kvcore_vllm.scheduler_side import NULL_BLOCK

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvcore_vllm.engine_spec import PDEngine

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


_SHORTENED = "_p_side_truncated"
"""The key a prefill request's params get once ``on_new_request`` dropped its last prompt token: vLLM's
NIXL connector's, so that two connectors of one engine never both drop one."""


def _blocks(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


class PDScheduler:
    """The P/D scheduler side of an engine whose model keeps ``groups`` KV-cache groups of one block size;
    ``stops_short``: the model has a sliding window or Mamba states, and both engines stop one token short
    of the prompt; ``hash_block`` is the tokens of vLLM's block hashes (the block size by default);
    ``state_groups`` the groups whose blocks hold a hybrid SSM model's recurrent states."""

    def __init__(
        self,
        role: PDRole,
        engine_id: str,
        block_tokens: int,
        tp_size: int,
        config: PDConfig,
        groups: int = 1,
        stops_short: bool = False,
        hash_block: int | None = None,
        state_groups: frozenset[int] = frozenset(),
    ) -> None:
        self.role = role
        self._engine_id = engine_id
        self._block = block_tokens
        self._groups = groups
        self._short = stops_short
        self._hash_block = hash_block or block_tokens
        self._state_groups = state_groups
        self._addresses = producer_addresses(config, tp_size) if role.produces else ()
        self._asked: dict[str, _Asked] = {}
        self._issued: set[str] = set()  # decode requests whose one transfer was issued
        self._receiving: set[str] = set()  # ... and not yet reported finished by the workers
        self._offers: list[Offer] = []
        self._receives: list[Receive] = []

    @classmethod
    def of(cls, role: PDRole, engine_id: str, moved: PDEngine, config: PDConfig) -> PDScheduler:
        """The scheduler side for the engine as P/D sees it (``engine_spec.pd_engine``)."""
        return cls(
            role,
            engine_id,
            moved.engine.layout.block_tokens,
            moved.engine.tp_size,
            config,
            moved.groups,
            stops_short=moved.windowed,
            hash_block=moved.hash_block,
            state_groups=moved.state_groups,
        )

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
        total = min(source.num_tokens, request.num_prompt_tokens - self._short)
        unusable = self._unusable(source, total, num_computed_tokens)
        if unusable:
            log.warning("kvcore P/D: request %s: %s; computing the prompt", request_id, unusable)
            total = num_computed_tokens
        self._asked[request_id] = _Asked(source, num_computed_tokens)
        count = total - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _unusable(self, source: RemotePrefill, total: int, local: int) -> str:
        """Why the producer's blocks cannot serve the prompt past a local hit of ``local`` tokens ("" when
        they can)."""
        if len(source.block_ids) != self._groups:
            return (
                f"the producer names {len(source.block_ids)} KV-cache groups, this engine has {self._groups}"
            )
        if self._short and total and source.num_tokens != total:
            # a state after every prompt token, or a window given back past the last token's: unusable
            return f"the producer computed {source.num_tokens} tokens, not the {total} before the last"
        held = min(len(group) for group in source.block_ids)
        if local % self._block or _blocks(total, self._block) > held:
            return f"{held} producer blocks cannot hold {total} tokens past a local hit of {local}"
        return ""

    def on_new_request(self, request: Request) -> None:
        """A prefill request of a model that stops short computes every prompt token but the last, which
        the decode engine computes (with its window whole, from the state before it); its one output token
        is not the answer's. Its block hashes lose a block the prompt no longer fills."""
        params = request.kv_transfer_params
        if not (self.role.produces and self._short and wants_remote_decode(params)):
            return
        if params.get(_SHORTENED) or request.num_prompt_tokens < 2 or request.get_skip_reading_prefix_cache():
            return  # already shortened, or nothing to leave, or the decode engine loads nothing for it
        if request.prompt_token_ids is None and request.prompt_embeds is None:
            return
        # new lists, the caller's own left whole; a prompt of tokens and embeddings loses both ends
        if request.prompt_token_ids is not None:
            request.prompt_token_ids = request.prompt_token_ids[:-1]
        if request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-1]
        if request.prompt_is_token_ids is not None:
            request.prompt_is_token_ids = request.prompt_is_token_ids[:-1]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        del request.block_hashes[request.num_prompt_tokens // self._hash_block :]
        request.max_tokens = 1
        if request.kv_transfer_params is not None:  # it is (``params``): typed as the dict vLLM holds
            request.kv_transfer_params[_SHORTENED] = True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        asked = self._asked.pop(request.request_id, None)
        if asked is None:
            return
        self._issued.add(request.request_id)
        source = asked.source
        first = asked.local_tokens // self._block
        last = _blocks(asked.local_tokens + num_external_tokens, self._block)
        kv: tuple[list[int], list[int]] = ([], [])
        states: tuple[list[int], list[int]] = ([], [])
        missing: list[int] = []
        pairs = zip(source.block_ids, blocks.get_block_ids(), strict=True) if num_external_tokens else ()
        for group, (remote, local) in enumerate(pairs):
            src, dst = states if group in self._state_groups else kv
            for theirs, ours in zip(remote[first:last], local[first:last], strict=True):
                if ours == NULL_BLOCK:
                    continue  # this engine keeps no block there: nothing to move
                if theirs == NULL_BLOCK:
                    missing.append(ours)  # the producer gave it back: it cannot be filled
                else:
                    src.append(theirs)
                    dst.append(ours)
        if missing:  # the request is recomputed whole: pull nothing, fail every block
            log.info(
                "kvcore P/D: request %s: the producer gave back %d blocks this engine needs; computing it",
                request.request_id,
                len(missing),
            )
            missing += kv[1] + states[1]
            kv, states = ([], []), ([], [])
        receive = Receive(request.request_id, source.transfer_id, source.addresses, *kv, missing, *states)
        self._receives.append(receive)
        if not receive.is_release:
            self._receiving.add(request.request_id)

    def tracked(self) -> int:
        """Decode requests this side keeps something for between vLLM's calls: 0 once every one ended."""
        return len(self.tracked_requests())

    def tracked_requests(self) -> frozenset[str]:
        """The decode requests ``tracked`` counts."""
        return frozenset(self._asked.keys() | self._issued | self._receiving)

    def build_connector_meta(self) -> PDMetadata:
        meta = PDMetadata(tuple(self._offers), tuple(self._receives))
        self._offers.clear()
        self._receives.clear()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._receiving.difference_update(connector_output.finished_recving or ())

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free of a prefill to be sent (returning its params) or of a decode still receiving;
        ``block_ids`` are the request's blocks in every KV-cache group."""
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
        if not (self.role.produces and wants_remote_decode(params) and finished and any(block_ids)):
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        held = tuple(tuple(group[: _blocks(num_tokens, self._block)]) for group in block_ids)
        transfer_id = uuid.uuid4().hex
        offered = sorted({block for group in held for block in group} - {NULL_BLOCK})
        self._offers.append(Offer(request_id, transfer_id, offered))
        source = RemotePrefill(transfer_id, self._engine_id, self._addresses, held, num_tokens)
        return True, source.to_params()
