"""What a fuzz run exercises: ``FuzzOptions``, one field per flag of ``kvcore fuzz``, so that the replay
line of a failure selects the same run."""

from __future__ import annotations

from attrs import frozen

from kvcore.errors import UsageError

__all__ = ["FuzzOptions"]


@frozen
class FuzzOptions:
    """What a run exercises. Every field is a flag of ``kvcore fuzz``, so a failure's replay line is exact.

    ``engine_blocks`` is the engine's KV memory (few, so blocks are reused at once) and ``pool_slots`` the
    host pool in chunks (few, so chunks are evicted). ``disk`` puts the disk tier's real store (files in a
    temporary directory) behind the pool instead of the in-memory one (it implies ``remote``); ``stack``
    cascades the disk and a smaller in-memory store behind it (``kvcore.scheduling.cascade_index``,
    ``kvcore.execution.cascade_remote``). ``write_back`` writes the disk tier back (``Tier.write``): chunks
    reach it when the pool is about to evict them, not at their save (with ``disk`` or ``stack``). ``window``
    makes the model's layers attend to a sliding window of that many blocks (0: full attention): the engine
    gives back the blocks that fall out of it while a request runs, and holds none before the window of a
    load. ``cross_tp`` (with ``disk`` or ``stack``) reads what the run wrote to its disk tier, after it, at
    another tensor-parallel size (``kvcore_cli.fuzz.cross_tp``).
    """

    remote: bool = False
    disk: bool = False
    stack: bool = False
    write_back: bool = False
    preempt: bool = True
    reset: bool = True
    faults: bool = True
    recompute_late: bool = True  # rule 4: recompute a late load's blocks at once (half the time), or hold
    tails: bool = True  # ``partial_chunks: keep``, and a final save before each finish
    engine_blocks: int = 40
    pool_slots: int = 16
    window: int = 0
    cross_tp: bool = False
    trace: int = 40  # API calls shown with a failure

    def __attrs_post_init__(self) -> None:
        if self.write_back and not (self.disk or self.stack):
            raise UsageError("write_back: the disk tier is written back, give disk or stack too")
        if self.cross_tp and not (self.disk or self.stack):
            raise UsageError(
                "cross_tp: what the disk tier holds is read at another TP size, give disk or stack"
            )
        if self.window < 0:
            raise UsageError(f"window: got {self.window!r}, expected a number of blocks >= 0 (0: none)")

    def flags(self) -> str:
        """The command-line flags that select these options (defaults left out)."""
        default = FuzzOptions()
        tiers = [("stack", self.stack), ("disk", self.disk), ("remote", self.remote)]
        out = [next(f"--{name}" for name, on in tiers if on)] if any(on for _, on in tiers) else []
        out += ["--write-back"] if self.write_back else []
        out += ["--cross-tp"] if self.cross_tp else []
        out += [f"--no-{name}" for name in ("preempt", "reset", "faults", "tails") if not getattr(self, name)]
        out += [] if self.recompute_late else ["--hold-late-loads"]
        out += [
            f"--{name.replace('_', '-')} {getattr(self, name)}"
            for name in ("engine_blocks", "pool_slots", "window")
            if getattr(self, name) != getattr(default, name)
        ]
        return " ".join(out)
