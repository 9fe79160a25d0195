"""What both sides of kvcore and every backend exchange: the values of the ports (block transfers, store
items, held chunks, memory regions, byte copies, a tier's usage), ``JobQueue``, which every asynchronous
port is, and ``SupportsClear``."""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import Protocol, runtime_checkable

from attrs import Attribute, field, frozen
from attrs.validators import ge, optional

from kvcore.checks import instance, int_ids, int_in, int_tuple
from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobResult

__all__ = [
    "BlockItem",
    "BlockTransfer",
    "ByteCopy",
    "Direction",
    "HeldChunks",
    "JobQueue",
    "MemoryRegion",
    "StoreItem",
    "SupportsClear",
    "TierUsage",
]


class Direction(enum.Enum):
    """Which way a block copy goes."""

    SAVE = "save"  # engine KV -> host
    LOAD = "load"  # host -> engine KV


def _same_length(instance: BlockTransfer, attribute: object, value: tuple[int, ...]) -> None:
    if len(value) != len(instance.engine_blocks):
        raise InvalidSpecError(
            f"host_blocks has {len(value)} entries, engine_blocks {len(instance.engine_blocks)}"
        )


@frozen
class BlockTransfer:
    """Copy whole blocks: ``engine_blocks[i]`` <-> ``host_blocks[i]``, for every layer of the shard.

    A host block holds one engine block of every layer, layer after layer; a host slot (one chunk) is
    ``blocks_per_chunk`` consecutive host blocks. With ``head`` (a mover of head blocks, ``BlockMovers.over``
    with ``per_head``), only that local KV head moves: a host block is then a *head block*, the head's runs
    of a host block one after another (``kvcore.model.head_runs``).
    """

    direction: Direction = field(validator=instance(Direction))
    engine_blocks: tuple[int, ...] = field(converter=int_tuple, validator=int_ids)
    host_blocks: tuple[int, ...] = field(converter=int_tuple, validator=[int_ids, _same_length])
    head: int | None = field(default=None, validator=optional(int_in(0)))


@frozen
class StoreItem:
    """One value of a chunk store: a key and the host bytes ``[offset, offset + length)`` it maps to.

    With ``runs``, the value is those host ranges ``(offset, length)`` one after another (a put gathers
    them, a get scatters into them), ``length`` bytes in all, ``offset`` the first run's: one KV head's
    value of a slot (``kvcore.model.head_runs``). Only a store whose backend keeps values per head
    (``BackendSettings.PER_HEAD``) is given runs.
    """

    key: ChunkKey
    offset: int
    length: int
    runs: tuple[tuple[int, int], ...] = ()

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The host ranges of the value, in order: ``runs``, or the one range."""
        return self.runs or ((self.offset, self.length),)


def _holders(_: object, attribute: Attribute[tuple[str, ...]], value: object) -> None:
    if not isinstance(value, tuple) or not value or not all(h and isinstance(h, str) for h in value):
        raise InvalidSpecError(
            f"HeldChunks.{attribute.name}: a tuple of one non-empty name per rank, got {value!r}"
        )


def _chunk_position(_: object, attribute: Attribute[int], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidSpecError(f"HeldChunks.{attribute.name}: a chunk position (an int >= 0), got {value!r}")


def _after_start(owner: HeldChunks, attribute: Attribute[int], value: int) -> None:
    if value <= owner.start:
        raise InvalidSpecError(f"HeldChunks.{attribute.name}: must exceed start ({owner.start}), got {value}")


@frozen
class HeldChunks:
    """Chunks ``[start, end)`` of a request's chain that a remote index's lookup keeps read-locked, for
    each rank under the name ``holders[rank]`` (opaque to the core: the tier's name of the lock's owner).

    The scheduler hands them to the workers with the request's load (``BlockOp.held``): each rank's tier
    reads those chunks without a lookup of its own and releases what it does not read
    (``SupportsAdoptedLocks``). Or it releases them itself, unread (``SupportsHeldLookups``).
    """

    holders: tuple[str, ...] = field(validator=_holders)
    start: int = field(validator=_chunk_position)
    end: int = field(validator=[_chunk_position, _after_start])


@frozen
class BlockItem:
    """One chunk that a tier moves straight between its own memory and engine blocks.

    ``engine_blocks[i]`` holds block ``first + i`` of the chunk (a store moves whole values: ``first`` is
    0 and every block of the value is given). ``value_blocks``: the key names a *tail*, a value of that
    many blocks (the leading whole blocks of a chunk, fewer than a chunk's); ``None``: a whole chunk.
    """

    key: ChunkKey
    engine_blocks: tuple[int, ...] = field(converter=int_tuple, validator=int_ids)
    first: int = field(default=0, validator=ge(0))
    value_blocks: int | None = field(default=None, validator=optional(ge(1)))


@frozen
class MemoryRegion:
    """A registered span of memory, by address: what a peer may write into."""

    address: int
    length: int


@frozen
class ByteCopy:
    """One contiguous copy from a local address to a peer's address."""

    src: int
    dst: int
    length: int


@frozen
class TierUsage:
    """How full a tier is: bytes held, the bytes it may hold, and the values it evicted since it was made
    (by every process that shares it)."""

    used_bytes: int
    capacity_bytes: int
    evictions: int


class JobQueue(Protocol):
    """Completion side shared by every asynchronous port."""

    def poll(self) -> tuple[JobResult, ...]:
        """Results of jobs finished since the last call; never blocks. Each result is handed out once."""
        ...

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        """Block until the given jobs finished and return their results.

        Raises ``TransferTimeout`` after ``timeout`` seconds; unfinished jobs keep running and are
        reported by a later ``poll``/``wait``.
        """
        ...


# -- scheduler side ------------------------------------------------------------------------------------


@runtime_checkable
class SupportsClear(Protocol):
    """A tier that can drop everything it holds (a test or operator action, never the hot path)."""

    def clear(self) -> None:
        """Drop every value. Jobs in flight finish or fail; none resurrects a cleared value."""
        ...
