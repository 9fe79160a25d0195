"""What the scheduler side knows of one request, beside its lifecycle tracker (``RequestState``), and a tail
of one of its chunks that a tier holds or a save keeps (``Tail``)."""

from __future__ import annotations

from attrs import frozen

from kvcore.ids import ChunkKey
from kvcore.ports import HeldChunks
from kvcore.scheduling.load_spec import LoadSpec
from kvcore.scheduling.remote_lookup import PendingLookup
from kvcore.scheduling.request_keys import ChunkChain

__all__ = ["RequestState", "Tail"]


@frozen
class Tail:
    """The first ``blocks`` blocks of request chunk ``chunk``, under ``key`` in the pool and under
    ``rank_keys`` (one per rank) in a remote tier, where it is the chain's next position after its full
    chunks. ``remote``: found in the remote tier, not in the pool."""

    chunk: int
    key: ChunkKey
    blocks: int
    rank_keys: tuple[ChunkKey, ...] = ()
    remote: bool = False


class RequestState:
    """One request on the scheduler side: its keys, what its lookup found, the load decided and started,
    what failed, how far it is saved and how far its chain was sent to the workers."""

    __slots__ = (
        "chain",
        "chain_sent",
        "failed_blocks",
        "held",
        "hit_chunks",
        "load",
        "load_errors",
        "load_from",
        "loaded",
        "local_hits",
        "lost_blocks",
        "pending",
        "prompt_tokens",
        "remote_tail",
        "saved_chunks",
        "tail",
        "tails_saved",
        "unloaded",
    )

    def __init__(self, chain: ChunkChain, prompt_tokens: int) -> None:
        self.chain = chain
        self.prompt_tokens = prompt_tokens
        self.pending: PendingLookup | None = None  # a remote lookup in flight
        self.held: HeldChunks | None = None  # the remote lookup's locks, until the load hands them over
        self.local_hits = 0  # leading chunks the local pool held when looked up
        self.hit_chunks: int | None = None  # leading chunks the tiers hold (None: not known yet)
        self.load: LoadSpec | None = None  # the load the last lookup decided
        self.loaded: LoadSpec | None = None  # the load started, kept for extra_cached_tokens
        self.load_from = 0  # request block index of its first block written (after blocks not held)
        self.failed_blocks: set[int] = set()  # request block indices whose load failed
        self.load_errors: list[int] = []  # engine block ids to recompute, any cause
        self.lost_blocks: list[int] = []  # the part the scheduler itself decided (chunk gone before the copy)
        self.saved_chunks = 0
        self.chain_sent = 0  # leading chain positions (``chain.rank_keys``) already sent to the workers
        self.tail: Tail | None = None  # the tail of the chunk after the hit's chunks that a tier holds
        # the prompt's tail, asked of the remote tier after the chain (while pending), or found there
        self.remote_tail: Tail | None = None
        self.tails_saved: set[tuple[int, int]] | None = set()  # (chunk, blocks); None: save no more
        # (plan, block): this plan's load gave up its blocks from ``block`` on before any copy
        self.unloaded: tuple[int, int] | None = None

    def stop_hit_at(self, chunk: int) -> None:
        """A chunk of the load is gone or failed: asked again (an engine that gave the request's blocks
        back), the lookup stops before it, so the same load is not tried again."""
        if self.hit_chunks is not None:
            self.hit_chunks = min(self.hit_chunks, chunk)
        if self.tail is not None and chunk <= self.tail.chunk:
            self.tail = None
