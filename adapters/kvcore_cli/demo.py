"""``kvcore demo``: a realistic workload through the engine-agnostic API on the embedded CPU backend.

A simulated engine (KV tensors of a real model's shape, vLLM's CPU layout, all layers in one storage)
serves multi-turn chats and agents. "Computing" a block writes bytes derived from the block's whole
prefix, so any block that comes back from kvcore can be checked byte for byte against what was saved: a
misplaced, stale or torn block cannot match.

The demo states its workload before it runs (``DemoWorkload``) and accounts for every prompt token: each
is either served from kvcore (loaded, and verified) or computed; answer tokens are counted apart. The
engine keeps no prefix cache of its own across requests, so without kvcore it computes every prompt
token: what kvcore saved is the prompt tokens it served. Its "compute" is a memory copy, so times measure
kvcore's copies and the simulation, not a model: the token and byte figures are what to read.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from array import array
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np
import torch
from attrs import define, frozen

from kvcore.config import KVCoreConfig, load_config, parse_size
from kvcore.errors import ConfigError
from kvcore.execution.worker import BlockWorker
from kvcore.ids import RequestId
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.step import StepPlan
from kvcore.plugins.compose import open_scheduler, open_worker
from kvcore.ports import Direction
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore_cli.progress import Progress
from kvcore_cli.workload import Turn, conversations, is_agent

__all__ = [
    "DemoOptions",
    "DemoSummary",
    "DemoWorkload",
    "RequestFigures",
    "TurnFigures",
    "run_demo",
    "write_json",
]

GiB = 1 << 30
KiB = 1 << 10
DTYPE_BYTES = 2  # bf16
NO_PREFIX_CACHE = (
    "the simulated engine keeps no prefix cache of its own: without kvcore it computes every prompt token"
)


@frozen
class DemoOptions:
    """The demo's settings (``kvcore demo --help``): the conversations, the model shape, the memory sizes."""

    chats: int = 24
    turns: int = 4
    seed: int = 0
    duration_s: float = 45.0
    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_tokens: int = 16
    chunk_tokens: int = 256
    engine_size: str = "1GiB"
    pool_size: str = "3GiB"
    progress: bool = True


def _tokens(n: int) -> str:
    return f"{n:,}"


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def _rows(title: str, rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(["", title, *(f"  {k:<{width}}  {v}" for k, v in rows)])


@frozen
class DemoWorkload:
    """What the demo serves: the conversations, the model shape, the engine's KV memory, kvcore's pool and
    the requests themselves (every turn, in the order served). Stated before the run and in its summary."""

    options: DemoOptions
    turns: tuple[Turn, ...]

    @classmethod
    def build(cls, options: DemoOptions) -> DemoWorkload:
        """The workload of ``options``; raises ``ConfigError`` naming the option that cannot work."""
        for name in ("chats", "turns", "layers", "kv_heads", "head_size", "block_tokens", "chunk_tokens"):
            value = getattr(options, name)
            if value < 1:
                raise ConfigError(name, value, "at least 1")
        workload = cls(options, tuple(conversations(options.chats, options.turns, options.seed)))
        longest = max(len(t.prompt) + len(t.answer) for t in workload.turns)
        if -(-longest // options.block_tokens) > workload.engine_blocks:
            raise ConfigError(
                "engine_size",
                options.engine_size,
                f"room for the longest request, {longest:,} tokens of "
                f"{workload.kv_bytes_per_token:,} bytes of KV each; it holds "
                f"{workload.engine_blocks * options.block_tokens:,} tokens",
            )
        if workload.pool_chunks < 1:
            raise ConfigError(
                "pool_size", options.pool_size, f"at least one chunk: {workload.chunk_bytes:,} bytes"
            )
        return workload

    @property
    def kv_bytes_per_token(self) -> int:
        o = self.options
        return o.layers * o.kv_heads * 2 * o.head_size * DTYPE_BYTES

    @property
    def engine_bytes(self) -> int:
        return parse_size(self.options.engine_size, "engine_size")

    @property
    def engine_blocks(self) -> int:
        return self.engine_bytes // (self.kv_bytes_per_token * self.options.block_tokens)

    @property
    def pool_bytes(self) -> int:
        return parse_size(self.options.pool_size, "pool_size")

    @property
    def chunk_bytes(self) -> int:
        return self.options.chunk_tokens * self.kv_bytes_per_token

    @property
    def pool_chunks(self) -> int:
        return self.pool_bytes // self.chunk_bytes

    @property
    def agents(self) -> int:
        return sum(map(is_agent, range(self.options.chats)))

    @property
    def shape(self) -> str:
        o = self.options
        return f"{o.layers} layers x {o.kv_heads} KV heads x {o.head_size} head size, bf16"

    def to_dict(self) -> dict[str, object]:
        o = self.options
        prompts = [len(t.prompt) for t in self.turns]
        return {
            "conversations": o.chats,
            "agents": self.agents,
            "turns_per_conversation": o.turns,
            "requests": len(self.turns),
            "seed": o.seed,
            "duration_limit_s": o.duration_s,
            "model": {
                "layers": o.layers,
                "kv_heads": o.kv_heads,
                "head_size": o.head_size,
                "dtype": "bfloat16",
            },
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_tokens": o.block_tokens,
            "chunk_tokens": o.chunk_tokens,
            "chunk_bytes": self.chunk_bytes,
            "engine_kv_bytes": self.engine_bytes,
            "engine_blocks": self.engine_blocks,
            "pool_bytes": self.pool_bytes,
            "pool_chunks": self.pool_chunks,
            "prompt_tokens": sum(prompts),
            "prompt_tokens_min": min(prompts),
            "prompt_tokens_median": statistics.median(prompts),
            "prompt_tokens_max": max(prompts),
            "answer_tokens": sum(len(t.answer) for t in self.turns),
        }

    def render(self) -> str:
        o = self.options
        prompts = [len(t.prompt) for t in self.turns]
        per_turn = ", ".join(
            f"{_tokens(int(statistics.median(len(t.prompt) for t in self.turns if t.turn == n)))}"
            for n in range(1, o.turns + 1)
        )
        rows = [
            (
                "conversations",
                f"{o.chats} ({o.chats - self.agents} chats, {self.agents} agents) x {o.turns} turns = "
                f"{len(self.turns)} requests, turns interleaved; seed {o.seed}",
            ),
            ("model shape", f"{self.shape}: {self.kv_bytes_per_token // KiB:,} KiB of KV per token"),
            (
                "engine KV memory",
                f"{self.engine_bytes / GiB:.2f} GiB = {self.engine_blocks:,} blocks of "
                f"{o.block_tokens} tokens ({_tokens(self.engine_blocks * o.block_tokens)} tokens)",
            ),
            (
                "kvcore pool",
                f"{self.pool_bytes / GiB:.2f} GiB on the CPU backend = {self.pool_chunks:,} chunks of "
                f"{o.chunk_tokens} tokens ({_tokens(self.pool_chunks * o.chunk_tokens)} tokens)",
            ),
            (
                "prompts",
                f"{_tokens(sum(prompts))} tokens, {_tokens(min(prompts))} to {_tokens(max(prompts))} per "
                f"request (median by turn: {per_turn})",
            ),
            (
                "answers",
                f"{_tokens(sum(len(t.answer) for t in self.turns))} tokens generated, after each prompt",
            ),
            ("time limit", f"{o.duration_s:g} s (the requests not served by then are left out)"),
        ]
        return _rows("kvcore demo workload", rows)


@frozen
class RequestFigures:
    """One request: its prompt split into tokens served from kvcore and tokens computed, its answer, and
    kvcore's pool after it."""

    conversation: int
    turn: int
    prompt_tokens: int
    served_tokens: int
    answer_tokens: int
    pool_used_chunks: int
    evictions: int

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.served_tokens


@frozen
class TurnFigures:
    """The requests of one turn number, summed: prompt tokens = served + computed."""

    turn: int
    requests: int
    prompt_tokens: int
    served_tokens: int
    computed_tokens: int
    answer_tokens: int


@define
class DemoSummary:
    """What the run did: per request, and in total (``verified_ok`` is False if any block came back wrong)."""

    workload: DemoWorkload
    requests: list[RequestFigures] = attrs.Factory(list)
    saved_bytes: int = 0
    load_seconds: float = 0.0
    verified_blocks: int = 0
    mismatched_blocks: int = 0
    failed_blocks: int = 0
    pool_capacity: int = 0
    pool_used: int = 0
    evictions: int = 0
    wall_seconds: float = 0.0

    @property
    def verified_ok(self) -> bool:
        return self.mismatched_blocks == 0

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def served_tokens(self) -> int:
        return sum(r.served_tokens for r in self.requests)

    @property
    def computed_tokens(self) -> int:
        return sum(r.computed_tokens for r in self.requests)

    @property
    def answer_tokens(self) -> int:
        return sum(r.answer_tokens for r in self.requests)

    @property
    def requests_served_from_kvcore(self) -> int:
        return sum(1 for r in self.requests if r.served_tokens)

    @property
    def loaded_bytes(self) -> int:
        return self.served_tokens * self.workload.kv_bytes_per_token

    @property
    def per_turn(self) -> list[TurnFigures]:
        out = []
        for n in sorted({r.turn for r in self.requests}):
            rs = [r for r in self.requests if r.turn == n]
            out.append(
                TurnFigures(
                    n,
                    len(rs),
                    sum(r.prompt_tokens for r in rs),
                    sum(r.served_tokens for r in rs),
                    sum(r.computed_tokens for r in rs),
                    sum(r.answer_tokens for r in rs),
                )
            )
        return out

    def to_dict(self) -> dict[str, object]:
        """Every figure, for ``--json``: the workload, the totals, the same without kvcore, per turn and per
        request (in the order served: the series over time)."""
        return {
            "workload": self.workload.to_dict(),
            "totals": {
                "requests": len(self.requests),
                "requests_served_from_kvcore": self.requests_served_from_kvcore,
                "prompt_tokens": self.prompt_tokens,
                "served_tokens": self.served_tokens,
                "computed_tokens": self.computed_tokens,
                "answer_tokens": self.answer_tokens,
                "loaded_bytes": self.loaded_bytes,
                "saved_bytes": self.saved_bytes,
                "load_seconds": self.load_seconds,
                "wall_seconds": self.wall_seconds,
                "verified_blocks": self.verified_blocks,
                "mismatched_blocks": self.mismatched_blocks,
                "failed_blocks": self.failed_blocks,
                "pool_capacity_chunks": self.pool_capacity,
                "pool_used_chunks": self.pool_used,
                "evictions": self.evictions,
            },
            "without_kvcore": {
                "computed_tokens": self.prompt_tokens,
                "prefill_avoided": self.served_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "note": NO_PREFIX_CACHE,
            },
            "notes": {
                "wall_seconds": "wall clock; the engine is simulated (its compute is a memory copy)",
                "load_seconds": "time waiting for kvcore's load copies into engine memory (real copies)",
            },
            "per_turn": [attrs.asdict(t) for t in self.per_turn],
            "requests": [{**attrs.asdict(r), "computed_tokens": r.computed_tokens} for r in self.requests],
        }

    def render(self) -> str:
        w, o = self.workload, self.workload.options
        prompt, served, computed = self.prompt_tokens, self.served_tokens, self.computed_tokens
        hits = self.requests_served_from_kvcore
        gbps = self.loaded_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0
        verdict = (
            f"OK: all {self.verified_blocks:,} loaded blocks equal, byte for byte, the KV that was saved"
            if self.verified_ok
            else f"FAILED: {self.mismatched_blocks:,} of {self.verified_blocks:,} loaded blocks differ"
        )
        rows = [
            (
                "workload",
                f"{o.chats} conversations x {o.turns} turns; {w.kv_bytes_per_token // KiB:,} KiB of KV a "
                f"token; engine {w.engine_bytes / GiB:.2f} GiB; pool {w.pool_bytes / GiB:.2f} GiB; "
                f"{o.chunk_tokens}-token chunks",
            ),
            (
                "requests",
                f"{len(self.requests)} of {len(w.turns)} served, {hits} ({_share(hits, len(self.requests))}) "
                f"with KV from kvcore, in {self.wall_seconds:.1f} s (simulated compute: not model time)",
            ),
            (
                "prompt tokens",
                f"{_tokens(prompt)} = {_tokens(served)} served from kvcore ({_share(served, prompt)}) "
                f"+ {_tokens(computed)} computed",
            ),
            ("without kvcore", f"{_tokens(prompt)} computed: the engine keeps no prefix cache of its own"),
            (
                "prefill avoided",
                f"{_share(served, prompt)}: {_tokens(served)} prompt tokens loaded "
                f"({self.loaded_bytes / GiB:.2f} GiB of KV) instead of computed",
            ),
            ("answer tokens", f"{_tokens(self.answer_tokens)} generated (decode; not in the prompt figures)"),
            ("KV stored", f"{self.saved_bytes / GiB:.2f} GiB into kvcore (new chunks, answers included)"),
            ("load copy throughput", f"{gbps:.1f} GB/s (real copies into engine memory, waits included)"),
            (
                "pool",
                f"{self.pool_used}/{self.pool_capacity} chunks used at the end, {self.evictions:,} evictions",
            ),
            ("failed loads", f"{self.failed_blocks} blocks (recomputed, counted as computed)"),
            ("verification", verdict),
        ]
        table = [
            "",
            "  per turn (without kvcore, every prompt token is computed)",
            f"  {'turn':>4} {'requests':>9} {'prompt tokens':>14} {'served from kvcore':>20} {'computed':>9}",
        ]
        table += [
            f"  {t.turn:>4} {t.requests:>9} {_tokens(t.prompt_tokens):>14} "
            f"{f'{_tokens(t.served_tokens)} ({_share(t.served_tokens, t.prompt_tokens)})':>20} "
            f"{_tokens(t.computed_tokens):>9}"
            for t in self.per_turn
        ]
        return "\n".join([_rows("kvcore demo summary", rows), *table])


def write_json(summary: DemoSummary, path: str) -> None:
    """Write ``summary.to_dict()`` to ``path`` as JSON."""
    Path(path).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")


class _Engine:
    """The simulated engine: KV memory, a block allocator, and deterministic "compute"."""

    def __init__(self, workload: DemoWorkload) -> None:
        opts = workload.options
        self.block_tokens = opts.block_tokens
        num_blocks = workload.engine_blocks
        self.layout = KVLayout(
            kind=LayoutKind.VLLM_CPU,
            num_blocks=num_blocks,
            block_tokens=opts.block_tokens,
            num_kv_heads=opts.kv_heads,
            head_size=opts.head_size,
            dtype_size=DTYPE_BYTES,
        )
        shape = (opts.layers, num_blocks, opts.kv_heads, opts.block_tokens, 2 * opts.head_size)
        self.storage = torch.zeros(shape, dtype=torch.bfloat16)
        self.tensors = list(self.storage.unbind(0))
        self.bytes = self.storage.view(torch.uint8).view(opts.layers, num_blocks, -1)
        gen = torch.Generator().manual_seed(opts.seed)
        ramp = torch.randint(0, 256, (1, opts.layers, self.bytes.shape[2]), dtype=torch.uint8, generator=gen)
        # 255 precomputed block contents (uint8 arithmetic wraps): computing or checking a block is then
        # one copy or one comparison at memory speed, with no allocation.
        self.patterns = (ramp + torch.arange(1, 256, dtype=torch.uint8).view(-1, 1, 1)).numpy()
        self.rows = self.bytes.numpy()  # numpy compares and copies strided rows at memory speed
        self.free = list(range(num_blocks))

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

    def release(self, blocks: Sequence[int]) -> None:
        self.free.extend(blocks)

    def _patterns(self, tokens: Sequence[int], first: int, stop: int) -> list[int]:
        """The patterns blocks ``[first, stop)`` of a request hold once computed: a function of the prefix."""
        out = []
        digest = hashlib.blake2b(digest_size=8)
        for j in range(stop):
            digest.update(array("I", tokens[j * self.block_tokens : (j + 1) * self.block_tokens]).tobytes())
            if j >= first:
                out.append(int.from_bytes(digest.copy().digest(), "little") % 255)
        return out

    def compute(self, tokens: Sequence[int], blocks: Sequence[int], first: int) -> None:
        for block, pattern in zip(blocks[first:], self._patterns(tokens, first, len(blocks)), strict=True):
            np.copyto(self.rows[:, block], self.patterns[pattern])

    def matches(self, tokens: Sequence[int], blocks: Sequence[int], first: int, stop: int) -> int:
        """How many of blocks ``[first, stop)`` hold exactly the bytes of their prefix."""
        patterns = self._patterns(tokens, first, stop)
        return sum(
            np.array_equal(self.rows[:, b], self.patterns[p])
            for b, p in zip(blocks[first:stop], patterns, strict=True)
        )


def _run_ops(
    sched: CacheScheduler, worker: BlockWorker, plan: StepPlan, timeout: float, summary: DemoSummary
) -> None:
    worker.execute(plan)
    loads = plan.op_ids(Direction.LOAD)
    if loads:
        start = time.perf_counter()
        reports = worker.wait(loads, timeout)
        summary.load_seconds += time.perf_counter() - start
    else:
        # a chat's next turn comes after its answer was read: its saves are done by then, however busy
        # the machine (a demo whose hits depended on the copy threads' speed would show none)
        reports = worker.wait(plan.op_ids(), timeout)
    sched.complete(reports)


def run_demo(workload: DemoWorkload) -> DemoSummary:
    """Serve the workload (until its time limit); returns the summary."""
    opts = workload.options
    engine = _Engine(workload)
    spec = EngineSpec(
        model_id="demo/llama-shape",
        kv_dtype="bfloat16",
        num_layers=opts.layers,
        total_kv_heads=opts.kv_heads,
        layout=engine.layout,
    )
    config: KVCoreConfig = load_config(
        {"backend": {"kind": "cpu", "size": opts.pool_size}, "chunk_tokens": opts.chunk_tokens}
    )
    sched = open_scheduler(config, spec)
    worker = open_worker(config, spec, engine.tensors)
    host_block = spec.host_block_bytes
    summary = DemoSummary(workload, pool_capacity=sched.pool.usage().capacity)
    progress = Progress(len(workload.turns), opts.progress)
    held: dict[RequestId, list[int]] = {}
    start = time.monotonic()
    try:
        for n, turn in enumerate(workload.turns):
            if time.monotonic() - start > opts.duration_s:
                break
            rid = RequestId(f"req-{n}")
            tokens = turn.prompt + turn.answer
            sched.lookup(rid, tokens=turn.prompt)
            need = -(-len(tokens) // opts.block_tokens)
            blocks = engine.allocate(need)
            while blocks is None:  # wait for delayed frees of earlier requests
                sched.complete(worker.wait([], 0.01) + worker.reports())
                for done in sched.take_finished():
                    engine.release(held.pop(done))
                blocks = engine.allocate(need)
            loaded = sched.start_load(rid, blocks)
            _run_ops(sched, worker, sched.take_plan(), config.transfer_timeout_s, summary)
            failed = sched.take_load_errors().get(rid, ())
            loaded_stop = min((blocks.index(b) for b in failed), default=loaded // opts.block_tokens)
            good = engine.matches(turn.prompt, blocks, 0, loaded_stop) if loaded_stop else 0
            summary.verified_blocks += loaded_stop
            summary.mismatched_blocks += loaded_stop - good
            summary.failed_blocks += len(failed)
            engine.compute(tokens, blocks, loaded_stop)
            saved = sched.save(rid, blocks, num_tokens=len(tokens), tokens=tokens)
            summary.saved_bytes += saved * sched.blocks_per_chunk * host_block
            _run_ops(sched, worker, sched.take_plan(), config.transfer_timeout_s, summary)
            if sched.finish(rid):
                held[rid] = blocks
            else:
                engine.release(blocks)
            for done in sched.take_finished():
                engine.release(held.pop(done))
            usage = sched.pool.usage()
            summary.requests.append(
                RequestFigures(
                    turn.conversation,
                    turn.turn,
                    len(turn.prompt),
                    loaded_stop * opts.block_tokens,
                    len(turn.answer),
                    usage.used,
                    usage.evictions,
                )
            )
            served = _share(summary.served_tokens, summary.prompt_tokens)
            progress.update(
                n + 1, f"{served} of prompt tokens from kvcore, pool {usage.used}/{usage.capacity}"
            )
        while sched.in_flight():
            sched.complete(worker.wait([], 0.05) + worker.reports())
    finally:
        progress.close()
        worker.close()
    usage = sched.pool.usage()
    summary.pool_used, summary.evictions = usage.used, usage.evictions
    summary.wall_seconds = time.monotonic() - start
    return summary
