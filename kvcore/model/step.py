"""The messages between the scheduler side and the workers: what to copy this step, and how it went.

They are frozen, picklable values: in vLLM they cross from the engine-core process to each worker inside
``KVConnectorMetadata``; in an engine that runs both sides in one process they are passed by hand.
"""

from __future__ import annotations

from attrs import field, frozen
from attrs.validators import ge, optional

from kvcore.checks import instance, int_ids, int_tuple
from kvcore.ids import ChunkKey, RequestId
from kvcore.ports.common import Direction, HeldChunks

__all__ = ["WRITE_BACK_SESSION", "BlockOp", "OpReport", "RemoteChunk", "StepPlan"]

WRITE_BACK_SESSION = RequestId("kvcore-write-back")
"""The request id of write-back ops (``BlockOp.write_back``), and the session they use on the tiers: they
belong to no request."""


@frozen
class RemoteChunk:
    """A chunk of an op that also crosses the remote tier: fetched into its host slot before a load's
    copy, or published from it after a save's copy.

    ``keys[rank]`` is that rank's shard key (``None``: the rank holds a replica another rank writes).
    The chunk's blocks are ``engine_blocks[first : first + count]`` of the op.

    The op moves blocks ``from_block`` on of the chunk (a load may start inside a chunk the engine
    partly holds). ``slot`` is ``None`` when the chunk has no host slot: the remote tier copies its engine
    blocks straight into or out of its own memory (``SupportsBlockTransfer``). An op's chunks either all
    have a slot or none has.

    ``value_blocks``: the chunk is a *tail* (its leading whole blocks, ``Keyer.tail_key``), whose value in
    the remote tier is that many blocks, the leading ones of its slot; ``None``: a whole chunk.
    """

    slot: int | None = field(validator=optional(ge(0)))
    keys: tuple[ChunkKey | None, ...]
    first: int = field(validator=ge(0))
    count: int = field(validator=ge(1))
    from_block: int = field(default=0, validator=ge(0))
    value_blocks: int | None = field(default=None, validator=optional(ge(1)))


@frozen
class BlockOp:
    """One copy job for every worker: engine block ``engine_blocks[i]`` <-> host block ``host_blocks[i]``.

    ``request_id`` names the request whose blocks are copied, so a worker can fence a preempted request's
    copies and tell when a finished request's last copy is done. ``remote`` lists the op's chunks that
    also cross a remote tier (empty for the CPU tier alone). An op whose remote chunks have no host slot
    has no host blocks: the remote tier moves every block of it.

    ``chain`` carries the request's keys (per rank, as in ``RemoteChunk.keys`` but never ``None``) at
    positions ``chain_from`` on that earlier ops of the request did not carry: a worker keeps each
    request's chain, which a chained remote tier needs (``ManagedTier``), without every op resending it.
    Its last position may hold a tail (``RemoteChunk.value_blocks``); the request's next op then carries
    that position again, and the worker drops what it had from ``chain_from`` on.

    ``held``: a load's chunks that the scheduler's lookup keeps read-locked for each rank
    (``SupportsHeldLookups``); the op's chain reaches ``held.end``, and each rank's tier adopts its
    locks (``SupportsAdoptedLocks``) before the op's fetch.

    ``write_back``: the op writes pool chunks back to the tiers written back (``SupportsWriteBack``)
    before the pool evicts them. It belongs to no request and copies no engine block: its block lists
    are empty, its ``remote`` chunks are its chunks (``first`` = the chunk's index, ``count`` = 1), and
    ``OpReport.failed`` names the chunks that no tier stored.
    """

    op_id: int
    direction: Direction = field(validator=instance(Direction))
    engine_blocks: tuple[int, ...] = field(converter=int_tuple, validator=int_ids)
    host_blocks: tuple[int, ...] = field(converter=int_tuple, validator=int_ids)
    request_id: str = ""
    remote: tuple[RemoteChunk, ...] = ()
    chain_from: int = field(default=0, validator=ge(0))
    chain: tuple[tuple[ChunkKey, ...], ...] = ()
    held: HeldChunks | None = field(default=None, validator=optional(instance(HeldChunks)))
    write_back: bool = False


@frozen
class StepPlan:
    """The copies the scheduler decided in one step, in submission order, the requests that ended since
    the previous plan (a managed tier ends their sessions once their last op is done), and the ops to
    fence.

    ``fenced`` are ops (of earlier plans, or of this one) whose engine blocks the engine no longer holds
    for their request (it was preempted and its blocks freed): a save among them keeps and publishes
    nothing a copy reads from now on, and a load among them writes nothing more. ``BlockWorker.execute``
    fences them before it starts anything, so an engine that executes each plan before it reuses freed
    blocks cannot save or load another request's KV.
    """

    ops: tuple[BlockOp, ...] = ()
    ended: tuple[str, ...] = ()
    fenced: tuple[int, ...] = field(default=(), converter=int_tuple, validator=int_ids)

    def op_ids(self, direction: Direction | None = None) -> tuple[int, ...]:
        return tuple(op.op_id for op in self.ops if direction is None or op.direction is direction)


@frozen
class OpReport:
    """How one worker (``rank``) finished one op. ``failed`` indexes into the op's block lists.

    ``chunks_intact``: the failure says nothing of the chunks' bytes (the op was refused before any byte
    moved, or fenced): the scheduler keeps serving them. Otherwise a failed load's chunks are suspect
    (a copy error, a checksum mismatch) and are never served again.

    ``placed``: for an op that published (a save or a write-back), for each of its ``remote`` chunks, the
    remote tiers that now hold this rank's shard of it (0: the first behind the pool); empty otherwise.
    """

    op_id: int
    rank: int = 0
    failed: tuple[int, ...] = ()
    error: str | None = None
    chunks_intact: bool = False
    placed: tuple[tuple[int, ...], ...] = ()
