"""What a fuzz run reports: ``FuzzSummary`` when every check held, ``FuzzFailure`` at the first that did
not."""

from __future__ import annotations

from collections.abc import Sequence

from attrs import define

__all__ = ["FuzzFailure", "FuzzSummary"]


@define
class FuzzSummary:
    """What one run did; a test asserts on it that the run really exercised each part."""

    seed: int
    steps: int = 0
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    preemptions: int = 0
    resets: int = 0
    lookups: int = 0
    hash_lookups: int = 0  # of ``lookups``: by the engine's block hashes
    loads_checked: int = 0
    blocks_verified: int = 0
    blocks_recomputed: int = 0  # in loads: reported failed or lost, computed again
    loads_given_up: int = 0  # late loads whose blocks were recomputed while the copy was in flight
    saved_chunks: int = 0
    mover_faults: int = 0
    remote_faults: int = 0
    lookup_faults: int = 0
    index_stalls: int = 0
    locks_handed_over: int = 0  # remote lookups' locks handed to the worker with a load
    late_jobs: int = 0
    evictions: int = 0
    written_back: int = 0  # pool chunks written back to the disk tier (``--write-back``)
    given_back: int = 0  # blocks out of a sliding window given back while their request ran (``--window``)
    window_loads: int = 0  # loads whose leading blocks the engine did not hold (before the hit's window)
    saves_fenced: int = 0  # saves still reading a block given back when it was handed out again
    cross_tp_size: int = 0  # the TP size they were read at (--cross-tp)
    cross_tp_prompts: int = 0  # prompts the run saved, looked up after it at another TP size (--cross-tp)
    cross_tp_loads: int = 0  # of them, found and loaded
    cross_tp_blocks: int = 0  # blocks those loads brought back, every rank's heads checked
    halts: tuple[int, ...] = ()  # the steps a fence gave up on a copy and halted the worker (resumed after)

    @property
    def faults(self) -> int:
        return self.mover_faults + self.remote_faults + self.lookup_faults

    def brief(self) -> str:
        return (
            f"seed {self.seed}: ok, {self.steps} steps, {self.requests} requests, {self.loads_checked} loads "
            f"checked ({self.blocks_verified} blocks verified), {self.preemptions} preemptions, "
            f"{self.resets} resets, {self.faults} faults"
        )

    def render(self) -> str:
        rows = [
            ("seed / steps", f"{self.seed} / {self.steps}"),
            (
                "requests",
                f"{self.requests} ({self.finished} finished, {self.aborted} aborted, "
                f"{self.preemptions} preemptions)",
            ),
            (
                "lookups",
                f"{self.lookups} ({self.hash_lookups} by block hashes; {self.locks_handed_over} remote "
                "ones' locks handed over)",
            ),
            ("loads checked", f"{self.loads_checked}"),
            (
                "blocks verified",
                f"{self.blocks_verified} (and {self.blocks_recomputed} failed or lost: recomputed)",
            ),
            (
                "chunks saved",
                f"{self.saved_chunks} ({self.evictions} evictions, {self.written_back} written back)",
            ),
            ("resets", f"{self.resets}"),
            (
                "sliding window",
                f"{self.given_back} blocks given back, {self.window_loads} loads of the last window only, "
                f"{self.saves_fenced} saves fenced as their blocks were reused",
            ),
            ("worker halts", f"{len(self.halts)}, each resumed at the next flush {list(self.halts)[:8]}"),
            (
                f"read at TP {self.cross_tp_size}",
                f"{self.cross_tp_prompts} prompts looked up, {self.cross_tp_loads} loaded, "
                f"{self.cross_tp_blocks} blocks checked on every rank",
            ),
            (
                "faults injected",
                f"{self.faults} ({self.mover_faults} mover, {self.remote_faults} remote, "
                f"{self.lookup_faults} lookups); {self.late_jobs} jobs late, "
                f"{self.index_stalls} index stalls",
            ),
            ("verification", "OK: every check held after every step"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(["", "kvcore fuzz summary", *(f"  {k:<{width}}  {v}" for k, v in rows)])


class FuzzFailure(Exception):
    """A check failed: the seed, the step, the request and what differed, a replay line, the last calls."""

    def __init__(
        self, seed: int, step: int, request: str | None, detail: str, replay: str, trace: Sequence[str]
    ) -> None:
        self.seed = seed
        self.step = step
        self.request = request
        self.detail = detail
        self.replay = replay
        self.trace = tuple(trace)
        about = f" ({request})" if request else ""
        lines = [
            f"kvcore fuzz: check failed at step {step}, seed {seed}{about}: {detail}",
            f"  replay: {replay}",
        ]
        if self.trace:
            lines.append(f"  last {len(self.trace)} calls:")
            lines += [f"    {line}" for line in self.trace]
        super().__init__("\n".join(lines))
