"""A rank's sessions on a remote tier: each request's chain (this rank's keys from the request's first
chunk on, pieced together from the ops' ``chain`` deltas), named in every fetch and publish as a chained
tier needs; the read locks a load takes over; and the end of a request's session once its last op ended."""

from __future__ import annotations

import logging

from kvcore.errors import BackendError
from kvcore.ids import ChunkKey
from kvcore.model.step import BlockOp
from kvcore.ports import HeldChunks, RemoteTier

__all__ = ["Sessions"]

log = logging.getLogger(__name__)


class Sessions:
    """The sessions of rank ``rank`` on ``remote`` (none without one)."""

    def __init__(self, rank: int, remote: RemoteTier | None) -> None:
        self._rank = rank
        self._remote = remote
        self._chains: dict[str, list[ChunkKey]] = {}  # request id -> this rank's chain
        self._ending: set[str] = set()  # ended requests whose sessions end after their last op

    def chain_of(self, request_id: str) -> tuple[ChunkKey, ...]:
        """The request's chain as known now (a run keeps it: a later op may replace the tail at its end)."""
        return tuple(self._chains.get(request_id, ()))

    def extend(self, op: BlockOp) -> None:
        """Put the op's chain delta at ``chain_from`` of its request's chain (dropping what followed)."""
        if not op.chain or self._remote is None:
            return
        chain = self._chains.setdefault(op.request_id, [])
        if op.chain_from > len(chain):
            log.warning(
                "kvcore: op %d: chain of %s resumes at %d past its %d known keys; left as it is",
                op.op_id,
                op.request_id,
                op.chain_from,
                len(chain),
            )
            return
        del chain[op.chain_from :]
        chain.extend(keys[self._rank] for keys in op.chain)

    def adopt(self, op: BlockOp, held: HeldChunks) -> None:
        """Take over this rank's locks of the op's held chunks, before anything reads them (even for a
        fenced op: the tier releases them with the session)."""
        chain = self._chains.get(op.request_id, [])
        if self._remote is None or self._rank >= len(held.holders) or len(chain) < held.end:
            log.warning(
                "kvcore: op %d: locks on chunks [%d, %d) of %s not taken over (%d holders, %d keys known)",
                op.op_id,
                held.start,
                held.end,
                op.request_id,
                len(held.holders),
                len(chain),
            )
            return
        self._remote.adopt(op.request_id, held.holders[self._rank], chain[: held.end], held.start, held.end)

    def ended(self, request_id: str, busy: bool) -> None:
        """The request ended: its session ends now, or once its last op is reported (``busy``)."""
        self._ending.add(request_id)
        if not busy:
            self.op_done(request_id, busy=False)

    def op_done(self, request_id: str, *, busy: bool) -> None:
        """One of the request's ops was reported (``busy``: others still run): end an ended request's
        session once none of its ops is in flight."""
        if busy or request_id not in self._ending:
            return
        self._ending.discard(request_id)
        self._chains.pop(request_id, None)
        if self._remote is not None:
            try:
                self._remote.end_session(request_id)
            except BackendError as exc:
                log.warning("kvcore: ending the session of %s failed: %s", request_id, exc)
