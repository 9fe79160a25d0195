"""The in-memory reference ``BlockMover`` (an ``OrderedMover``)."""

from __future__ import annotations

from functools import partial

from kvcore.errors import (
    InvalidSpecError,
)
from kvcore.ids import JobId
from kvcore.jobs import JobResult
from kvcore.ports import BlockTransfer, Direction
from kvcore.testing.memory.common import POISON, Jobs, check_positive

__all__ = ["InMemoryBlockMover"]


class InMemoryBlockMover(Jobs):
    """Engine KV memory (one ``bytearray`` per layer) and host memory (one ``bytearray``), as blocks.

    An engine block is ``layer_block_bytes`` in each layer; a host block holds one engine block of every
    layer, layer after layer (``host_block_bytes`` in all).
    """

    def __init__(
        self, *, num_engine_blocks: int, num_host_blocks: int, layer_block_bytes: int, num_layers: int = 1
    ) -> None:
        super().__init__()
        for name, value in [
            ("num_engine_blocks", num_engine_blocks),
            ("num_host_blocks", num_host_blocks),
            ("layer_block_bytes", layer_block_bytes),
            ("num_layers", num_layers),
        ]:
            check_positive(name, value)
        self.num_engine_blocks = num_engine_blocks
        self.num_host_blocks = num_host_blocks
        self.layer_block_bytes = layer_block_bytes
        self.host_block_bytes = layer_block_bytes * num_layers
        self._engine = tuple(bytearray(num_engine_blocks * layer_block_bytes) for _ in range(num_layers))
        self._host = bytearray(num_host_blocks * self.host_block_bytes)

    @property
    def host(self) -> bytearray:
        """The host memory itself, to register with a store that fills and drains it."""
        return self._host

    def submit(self, transfer: BlockTransfer) -> JobId:
        return self.submit_after(transfer, None)

    def mark(self) -> None:
        """No mark is needed: the engine's writes to ``bytearray``s are done when it calls kvcore."""

    def reopen(self) -> bool:
        """``SupportsReopen``: open again once every job submitted before ``close`` has ended."""
        with self._cond:
            if self._closed and self._board.in_flight():
                return False
            self._closed = False
            return True

    def submit_after(self, transfer: BlockTransfer, mark: object) -> JobId:
        """``submit`` (``OrderedMover``): jobs run in submission order, whichever thread submits them."""
        for name, blocks, bound in [
            ("engine_blocks", transfer.engine_blocks, self.num_engine_blocks),
            ("host_blocks", transfer.host_blocks, self.num_host_blocks),
        ]:
            bad = [b for b in blocks if not 0 <= b < bound]
            if bad:
                raise InvalidSpecError(f"{name} {bad} outside [0, {bound})")
        pairs = tuple(zip(transfer.engine_blocks, transfer.host_blocks, strict=True))
        return self._submit(partial(self._copy, transfer.direction, pairs))

    def _copy(self, direction: Direction, pairs: tuple[tuple[int, int], ...], job_id: JobId) -> JobResult:
        failed: list[int] = []
        with self._cond:
            for i, (engine_block, host_block) in enumerate(pairs):
                if self._take_failure():
                    failed.append(i)
                    poison = bytes([POISON]) * self.host_block_bytes
                    if direction is Direction.SAVE:
                        self._write_host(host_block, poison)
                    else:
                        self._write_engine(engine_block, poison)
                elif direction is Direction.SAVE:
                    self._write_host(host_block, self._read_engine(engine_block))
                else:
                    self._write_engine(engine_block, self._read_host(host_block))
        return JobResult(job_id, tuple(failed))

    def _engine_span(self, block: int) -> slice:
        return slice(block * self.layer_block_bytes, (block + 1) * self.layer_block_bytes)

    def _host_span(self, block: int) -> slice:
        return slice(block * self.host_block_bytes, (block + 1) * self.host_block_bytes)

    def _read_engine(self, block: int) -> bytes:
        return b"".join(layer[self._engine_span(block)] for layer in self._engine)

    def _write_engine(self, block: int, data: bytes) -> None:
        step = self.layer_block_bytes
        for n, layer in enumerate(self._engine):
            layer[self._engine_span(block)] = data[n * step : (n + 1) * step]

    def _read_host(self, block: int) -> bytes:
        return bytes(self._host[self._host_span(block)])

    def _write_host(self, block: int, data: bytes) -> None:
        self._host[self._host_span(block)] = data

    # Out-of-band access, for tests: an engine block reads as the bytes a host block would hold.

    def read_engine_block(self, block: int) -> bytes:
        with self._cond:
            return self._read_engine(block)

    def write_engine_block(self, block: int, data: bytes) -> None:
        self._check_block_bytes(data)
        with self._cond:
            self._write_engine(block, data)

    def read_host_block(self, block: int) -> bytes:
        with self._cond:
            return self._read_host(block)

    def write_host_block(self, block: int, data: bytes) -> None:
        self._check_block_bytes(data)
        with self._cond:
            self._write_host(block, data)

    def _check_block_bytes(self, data: bytes) -> None:
        if len(data) != self.host_block_bytes:
            raise InvalidSpecError(f"a block is {self.host_block_bytes} bytes, got {len(data)}")
