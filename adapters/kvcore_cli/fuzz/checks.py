"""The byte checks of a fuzz run, against the KV oracle: every block a load brings back, every host block a
save reports stored, and every engine block the engine relies on, after every step. A block's bytes of
another request, another salt, an earlier epoch, a failed copy or never written are told apart, and named
in the error.

A shadow of every block handed to ``save`` (a fingerprint of its bytes at that moment) must also match
what a load brings back.
"""

from __future__ import annotations

import numpy as np

from kvcore.model.step import BlockOp, OpReport
from kvcore_cli.fuzz.memory import EngineMemory, held
from kvcore_cli.fuzz.oracle import Bytes, KVOracle, fingerprint
from kvcore_cli.fuzz.requests import BLOCK_TOKENS, Request, RequestBook
from kvcore_cli.fuzz.trace import Trace

__all__ = ["KVChecks"]


class KVChecks:
    """``host_kv`` is the host pool's bytes, ``[host block, layer, head, token slot, K and V bytes]``."""

    def __init__(
        self, memory: EngineMemory, oracle: KVOracle, book: RequestBook, host_kv: Bytes, trace: Trace
    ) -> None:
        self._memory = memory
        self._oracle = oracle
        self._book = book
        self._host_kv = host_kv
        self._trace = trace
        self._shadow: dict[tuple[int, bytes], bytes] = {}  # (epoch, block hash) -> fingerprint at save
        self._saving: dict[int, tuple[Bytes, ...]] = {}  # save op -> the bytes of each block it reads

    def handed_to_save(self, req: Request) -> None:
        """Shadow the request's full blocks not shadowed yet."""
        full = req.computed // BLOCK_TOKENS
        for j in range(req.shadowed, full):
            block = req.blocks[j]
            if block is not None:  # given back: shadowed when computed, or not the engine's to save
                self._shadow[(req.epoch, req.hashes[j])] = fingerprint(self._memory.kv[:, block])
        req.shadowed = max(req.shadowed, full)

    def new_epoch(self) -> None:
        self._shadow.clear()

    def save_planned(self, op: BlockOp, allowed: set[int]) -> None:
        """What the save must store: the bytes its blocks (those of them it may read) hold now."""
        self._saving[op.op_id] = tuple(self._memory.expect[b] for b in op.engine_blocks if b in allowed)

    def reported(self, op: BlockOp, report: OpReport) -> None:
        """A save's host blocks reported stored hold the bytes of its engine blocks."""
        for i, want in enumerate(self._saving.pop(op.op_id, ())):
            slot_block = self._host_kv[op.host_blocks[i]]
            if i not in report.failed and not np.array_equal(slot_block, want):
                self._trace.fail(
                    op.request_id,
                    f"save {op.op_id} reported host block {op.host_blocks[i]} (from engine block "
                    f"{op.engine_blocks[i]}) stored, but it holds {self._oracle.whose(slot_block)}; "
                    f"expected {self._oracle.whose(want)}",
                )

    def loaded(self, req: Request, j: int) -> None:
        """Block ``j`` of the request, loaded, holds its KV: the bytes handed to save."""
        block = held(req, j)
        got = self._memory.kv[:, block]
        want = self._oracle.slots(req, j, (j + 1) * BLOCK_TOKENS)
        where = f"loaded block {j} (engine block {block}, salt {req.chat.salt}, epoch {req.epoch})"
        if not np.array_equal(got, want):
            self._trace.fail(
                req.rid, f"{where} holds {self._oracle.whose(got)}; expected {self._oracle.whose(want)}"
            )
        shadow = self._shadow.get((req.epoch, req.hashes[j]))
        if shadow is None:
            self._trace.fail(
                req.rid, f"{where}: no request handed a block of these tokens to save in this epoch"
            )
        if shadow != fingerprint(got):
            self._trace.fail(req.rid, f"{where} differs from the bytes handed to save")

    def engine_memory(self) -> None:
        """Every block the engine relies on (held, or in its prefix cache) holds the KV it computed or
        loaded in every slot it computed or loaded: no copy wrote into them since."""
        for block, want in self._memory.expect.items():
            got = self._memory.kv[:, block]
            if not np.array_equal(got[:, :, : want.shape[2]], want):
                owners = self._book.owners(block)
                self._trace.fail(
                    owners[0] if owners else None,
                    f"engine block {block} (held by {owners or 'the prefix cache'}) changed under the "
                    f"engine: holds {self._oracle.whose(got)}; expected {self._oracle.whose(want)}",
                )
