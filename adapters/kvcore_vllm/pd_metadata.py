"""What the P/D connector's scheduler side tells its workers each step (picklable frozen attrs values).

vLLM sends ``KVConnectorMetadata`` from the engine-core process to every worker rank; each rank does its
part: a producer rank holds its blocks of each offer, a consumer rank receives its head slice of each
receive. Completions come back through ``get_finished`` (request ids), not through metadata.
"""

from __future__ import annotations

from attrs import field, frozen
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvcore.checks import int_ids, int_tuple
from kvcore_vllm.metadata import GroupedMetadata, KVCoreMetadata

__all__ = ["Offer", "PDMetadata", "PDTiersMetadata", "Receive"]


@frozen
class Offer:
    """Producer: hold ``blocks`` of the finished prefill ``request_id`` under ``transfer_id``."""

    request_id: str
    transfer_id: str
    blocks: tuple[int, ...] = field(converter=int_tuple, validator=int_ids)


@frozen
class Receive:
    """Consumer: pull producer blocks ``src_blocks[i]`` into ``dst_blocks[i]`` for ``request_id``;
    ``missing`` are this engine's blocks the producer holds no block for (it gave them back), failed when
    the pull ends; ``state_src_blocks`` and ``state_dst_blocks`` are the pairs of a hybrid SSM model's
    state groups (their blocks hold a recurrent state, moved by its own plan).

    Empty block lists release the producer's blocks without pulling anything (the request was aborted
    before allocation, or the local prefix cache held everything): no completion is reported to vLLM.
    """

    request_id: str
    transfer_id: str
    addresses: tuple[str, ...]
    src_blocks: tuple[int, ...] = field(converter=int_tuple, validator=int_ids)
    dst_blocks: tuple[int, ...] = field(converter=int_tuple, validator=int_ids)
    missing: tuple[int, ...] = field(default=(), converter=int_tuple, validator=int_ids)
    state_src_blocks: tuple[int, ...] = field(default=(), converter=int_tuple, validator=int_ids)
    state_dst_blocks: tuple[int, ...] = field(default=(), converter=int_tuple, validator=int_ids)

    @property
    def written(self) -> tuple[int, ...]:
        """Every block of this engine the pull writes."""
        return self.dst_blocks + self.state_dst_blocks

    @property
    def is_release(self) -> bool:
        return not (self.written or self.missing)


@frozen
class PDMetadata(KVConnectorMetadata):
    """One step's new transfers, for every rank."""

    offers: tuple[Offer, ...] = ()
    receives: tuple[Receive, ...] = ()


@frozen
class PDTiersMetadata(KVConnectorMetadata):
    """One step's instructions for a connector that serves both P/D and tiers: each side's own."""

    tiers: KVCoreMetadata | GroupedMetadata
    pd: PDMetadata
