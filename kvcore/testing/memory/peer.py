"""The in-memory reference ``PeerTransport``, over an address space several transports share."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from functools import partial

from kvcore.errors import (
    ConfigError,
    InvalidSpecError,
)
from kvcore.ids import JobId
from kvcore.jobs import JobResult
from kvcore.ports import ByteCopy, MemoryRegion
from kvcore.testing.memory.common import POISON, Jobs, check_positive

__all__ = ["InMemoryAddressSpace", "InMemoryPeerTransport"]


class InMemoryAddressSpace:
    """Fake process memory shared by the ``InMemoryPeerTransport``s built on it.

    Allocations get addresses that never touch (a gap separates them), so a copy that strays out of
    one is caught. Each transport's registered regions are listed under its peer name.
    """

    _GAP = 0x1000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memory: dict[int, bytearray] = {}
        self._next = self._GAP
        self._registered: dict[str, list[MemoryRegion]] = {}

    def allocate(self, length: int) -> MemoryRegion:
        """A new zeroed span of ``length`` bytes."""
        check_positive("length", length)
        with self._lock:
            address = self._next
            self._memory[address] = bytearray(length)
            self._next += length + self._GAP
            return MemoryRegion(address, length)

    def read(self, address: int, length: int) -> bytes:
        memory, start = self._locate(address, length)
        return bytes(memory[start : start + length])

    def write(self, address: int, data: bytes) -> None:
        memory, start = self._locate(address, len(data))
        memory[start : start + len(data)] = data

    def holds(self, address: int, length: int) -> bool:
        """Whether ``[address, address + length)`` lies inside one allocation."""
        return self._find(address, length) is not None

    def view(self, region: MemoryRegion) -> memoryview:
        """A writable view sharing the bytes of ``region`` (inside one allocation): out-of-band access
        for a test that lays structured data over it (``torch.frombuffer``). Raises
        ``InvalidSpecError`` outside allocated memory."""
        memory, start = self._locate(region.address, region.length)
        return memoryview(memory)[start : start + region.length]

    def _find(self, address: int, length: int) -> tuple[bytearray, int] | None:
        with self._lock:
            for base, memory in self._memory.items():
                if length >= 1 and base <= address and address + length <= base + len(memory):
                    return memory, address - base
        return None

    def _locate(self, address: int, length: int) -> tuple[bytearray, int]:
        found = self._find(address, length)
        if found is None:
            raise InvalidSpecError(f"[{address:#x}, +{length}) is not allocated memory")
        return found

    def _join(self, name: str) -> None:
        with self._lock:
            if name in self._registered:
                raise ConfigError("name", name, "a peer name not yet used in this address space")
            self._registered[name] = []

    def _register(self, name: str, regions: Sequence[MemoryRegion]) -> None:
        with self._lock:
            self._registered[name].extend(regions)

    def _unregister(self, name: str, regions: Sequence[MemoryRegion] | None) -> None:
        """Drop ``name``'s registrations that one of ``regions`` covers (``None``: all of them)."""
        with self._lock:
            self._registered[name] = [
                r
                for r in self._registered[name]
                if regions is not None
                and not any(
                    g.address <= r.address and r.address + r.length <= g.address + g.length for g in regions
                )
            ]

    def _regions_of(self, peer: str) -> tuple[MemoryRegion, ...] | None:
        with self._lock:
            regions = self._registered.get(peer)
            return None if regions is None else tuple(regions)


class InMemoryPeerTransport(Jobs):
    """Pushes bytes between transports that share one ``InMemoryAddressSpace``; its ``address`` is the
    name it is built with.

    A write to an unknown peer fails every copy; a copy whose destination the peer has not registered
    fails; a source outside allocated memory is refused at submit (sources need no registration).
    ``close`` withdraws the registrations at once; jobs queued before it still run.
    """

    def __init__(self, space: InMemoryAddressSpace, name: str) -> None:
        super().__init__()
        space._join(name)
        self._space = space
        self.address = name

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        bad = [r for r in regions if not self._space.holds(r.address, r.length)]
        if bad:
            raise InvalidSpecError(f"regions {bad} are not allocated memory; nothing registered")
        with self._cond:
            self._check_open("register")
            self._space._register(self.address, regions)

    def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        self._space._unregister(self.address, regions)

    def submit_write(self, peer: str, copies: Sequence[ByteCopy]) -> JobId:
        bad = [c for c in copies if not self._space.holds(c.src, c.length)]
        if bad:
            raise InvalidSpecError(f"copies {bad} read outside allocated memory; nothing copied")
        with self._cond:
            self._check_open("submit_write")
            return self._submit(partial(self._write, peer, tuple(copies)))

    def submit_write_columns(
        self, peer: str, srcs: Collection[int], dsts: Collection[int], lengths: Collection[int]
    ) -> JobId:
        if not len(srcs) == len(dsts) == len(lengths):
            raise InvalidSpecError(
                f"srcs, dsts and lengths: got {len(srcs)}, {len(dsts)} and {len(lengths)} entries, "
                "expected columns of one length"
            )
        copies = [ByteCopy(int(s), int(d), int(n)) for s, d, n in zip(srcs, dsts, lengths, strict=True)]
        return self.submit_write(peer, copies)

    def close(self) -> None:
        with self._cond:
            super().close()
            self._space._unregister(self.address, None)

    def _write(self, peer: str, copies: tuple[ByteCopy, ...], job_id: JobId) -> JobResult:
        regions = self._space._regions_of(peer)
        if regions is None:
            return JobResult(job_id, tuple(range(len(copies))), f"unknown peer {peer!r}")
        failed: list[int] = []
        for i, copy in enumerate(copies):
            registered = any(
                r.address <= copy.dst and copy.dst + copy.length <= r.address + r.length for r in regions
            )
            if self._take_failure() or not registered:
                failed.append(i)
                if registered:
                    self._space.write(copy.dst, bytes([POISON]) * copy.length)
            else:
                self._space.write(copy.dst, self._space.read(copy.src, copy.length))
        return JobResult(job_id, tuple(failed))
