"""The ``kv_transfer_params`` of kvcore's P/D connector: what a prefill's output tells the decode engine.

The producer's ``request_finished`` returns ``RemotePrefill.to_params()``; a proxy copies that dict into
the decode request untouched, where ``RemotePrefill.from_params`` reads it back. Field names follow
vLLM's own Mooncake and NIXL connectors (schema in ``docs/pd.md``). Params come from the network through
a proxy: anything malformed is a miss (``None`` and a warning, the decode engine computes the prompt),
never an exception.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

from attrs import field, frozen
from attrs.validators import ge, min_len

from kvcore.checks import int_ids, int_tuple

__all__ = ["RemotePrefill", "rank_addresses", "wants_remote_decode", "wants_remote_prefill"]

log = logging.getLogger(__name__)

_ADDRESS = re.compile(r"^(tcp://[^\s:]+):(\d{1,5})$")


def _str_tuple(values: Iterable[object]) -> tuple[str, ...]:
    return tuple(str(v) for v in values)


def _group_tuples(groups: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(int_tuple(group) for group in groups)


def _group_ids(instance: object, attribute: Any, value: tuple[tuple[int, ...], ...]) -> None:
    for group in value:
        int_ids(instance, attribute, group)


@frozen
class RemotePrefill:
    """Where a prefilled prompt's KV waits: the producer engine, its ranks' side channels, its blocks.

    ``block_ids[g][j]`` holds the prompt's tokens ``[j * block, (j + 1) * block)`` of KV-cache group
    ``g`` on every producer rank (one list per group, in vLLM's group order; vLLM's null block where the
    producer gave a block back: a sliding window's blocks before it); ``num_tokens`` is how many prompt
    tokens have KV there.
    """

    transfer_id: str = field(validator=min_len(1))
    engine_id: str
    addresses: tuple[str, ...] = field(converter=_str_tuple, validator=min_len(1))
    block_ids: tuple[tuple[int, ...], ...] = field(
        converter=_group_tuples, validator=[min_len(1), _group_ids]
    )
    num_tokens: int = field(validator=ge(0))

    def to_params(self) -> dict[str, Any]:
        """The dict the producer's ``request_finished`` returns (JSON-ready)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": self.transfer_id,
            "remote_engine_id": self.engine_id,
            "remote_bootstrap_addr": self.addresses[0],
            "remote_tp_size": len(self.addresses),
            "remote_block_ids": [list(group) for group in self.block_ids],
            "remote_num_tokens": self.num_tokens,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemotePrefill | None:
        """The remote prefill a decode request names, or ``None`` (logged) when its params are malformed."""
        try:
            groups = params["remote_block_ids"]
            if not isinstance(groups, list) or not groups or not all(isinstance(g, list) for g in groups):
                raise ValueError(f"remote_block_ids must be one list per KV-cache group, got {groups!r}")
            fields = (
                params["transfer_id"],
                params["remote_engine_id"],
                params["remote_bootstrap_addr"],
                params["remote_tp_size"],
                params["remote_num_tokens"],
            )
            transfer_id, engine_id, bootstrap, tp_size, num_tokens = fields
            if not all(isinstance(v, str) for v in (transfer_id, engine_id, bootstrap)):
                raise ValueError("transfer_id, remote_engine_id and remote_bootstrap_addr must be strings")
            ids = [v for group in groups for v in group]
            if not all(_is_int(v) for v in (tp_size, num_tokens, *ids)):
                raise ValueError("remote_tp_size, remote_num_tokens and block ids must be integers")
            return cls(transfer_id, engine_id, rank_addresses(bootstrap, tp_size), groups, num_tokens)
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("kvcore P/D: ignoring malformed kv_transfer_params (%s): %s", exc, dict(params))
            return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def rank_addresses(bootstrap: str, tp_size: int) -> tuple[str, ...]:
    """Producer rank ``r``'s side channel: the bootstrap port plus ``r`` (``listen_port``'s rule)."""
    match = _ADDRESS.match(bootstrap)
    if match is None or not 1 <= tp_size <= 1024:
        raise ValueError(f"bootstrap address {bootstrap!r} with TP size {tp_size}: expected tcp://host:port")
    host, port = match.group(1), int(match.group(2))
    if not 0 < port <= 65536 - tp_size:
        raise ValueError(f"bootstrap address {bootstrap!r}: ports {port}..{port + tp_size - 1} out of range")
    return tuple(f"{host}:{port + rank}" for rank in range(tp_size))


def wants_remote_prefill(params: Mapping[str, Any] | None) -> TypeGuard[Mapping[str, Any]]:
    """The request's KV was prefilled elsewhere (a decode request)."""
    return params is not None and params.get("do_remote_prefill") is True


def wants_remote_decode(params: Mapping[str, Any] | None) -> TypeGuard[Mapping[str, Any]]:
    """The request's KV is to be decoded elsewhere (a prefill request)."""
    return params is not None and params.get("do_remote_decode") is True
