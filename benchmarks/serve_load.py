"""Served load for ``bench_serve``: workloads as sessions of turns, and streaming HTTP clients that run them.

A workload is a list of phases run one after the other; a phase is a list of sessions, run by up to
``clients`` clients at once; a session is a list of turns one client runs in order. A chat session
carries its history: each turn's prompt is the last prompt, the answer (the token ids the server
streamed) and the new user tokens. Prompts are token ids (``/v1/completions`` takes them as they are: no
tokenizer between the workload and the engine), drawn in ``[10, 250)`` so that every model with a
vocabulary of 256 or more takes them. Between phases a workload may ask the server to forget its own
prefix cache (``/reset_prefix_cache``): a burst on a prefix that only the connector still holds. A
session may wait until the phase's other sessions have streamed some tokens, and a phase may run every
session at once whatever the number of clients (the stall workload: streams decoding, then loads
arriving among them, whatever the model's pace).

Each request is one streaming completion (``stream: true``, usage in the last chunk): its time to first
token, the gaps between its tokens, the tokens the server says were cached, its token ids, or its error.
"""

from __future__ import annotations

import http.client
import itertools
import json
import queue
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from urllib.parse import urlsplit

from attrs import field, frozen

__all__ = [
    "Phase", "Record", "Session", "Turn", "Workload", "WORKLOADS", "run_phase", "stall", "stall_streams",
    "workload",
]  # fmt: skip

REQUEST_TIMEOUT_S = 600.0


@frozen
class Turn:
    """New prompt tokens (after the history, for a chat), and how many tokens to generate."""

    tokens: tuple[int, ...]
    max_tokens: int


@frozen
class Session:
    name: str
    turns: tuple[Turn, ...]
    chat: bool = False  # each turn's prompt is the history, the answer, then the turn's tokens
    start_after_tokens: int = 0
    """It starts once every session of its phase that does not wait has streamed this many tokens (or
    ended); only in a phase that runs every session at once (``Phase.all_at_once``)."""


@frozen
class Phase:
    sessions: tuple[Session, ...]
    reset_before: bool = False  # the server forgets its own prefix cache first
    timed: bool = True  # counted in the figures (a warm-up or a priming phase is not)
    all_at_once: bool = False  # a client per session, whatever ``clients``


@frozen
class Workload:
    name: str
    describe: str
    phases: tuple[Phase, ...]


@frozen
class Record:
    """One request: its session and turn, prompt length, what came back, and when."""

    session: str
    turn: int
    prompt_tokens: int
    started: float
    ttft: float | None = None
    gaps: tuple[float, ...] = ()  # per token: a chunk's wait shared by the tokens it carried
    chunks: tuple[tuple[float, int], ...] = ()  # when each streamed chunk came (monotonic), its tokens
    output: tuple[int, ...] = ()
    cached_tokens: int = 0
    ended: float = 0.0
    error: str | None = field(default=None)


STREAM, LOAD = "stream-", "loads"
STALL_STREAMS = 8
STALL_LOADS = 3
STALL_LONG = 3  # a loaded prompt: this many times --prefix-tokens
STALL_ANSWER = 12  # a stream's answer: this many times --answer-tokens


def stall_streams(users: int) -> int:
    """The stall workload's decoding streams for ``users`` clients."""
    return min(users, STALL_STREAMS)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(10, 250) for _ in range(n))


def workload(
    name: str, *, users: int, turns: int, prefix_tokens: int, turn_tokens: int, answer_tokens: int, seed: int
) -> Workload:
    """The named workload (``WORKLOADS``), its sizes from the benchmark's flags."""
    rng = random.Random(f"{name}/{seed}")
    warm = Phase(tuple(Session(f"warm-{i}", (Turn(_tokens(rng, 64), 4),)) for i in range(2)), timed=False)
    if name == "chat":
        system = _tokens(rng, prefix_tokens)
        sessions = tuple(
            Session(
                f"user-{u}",
                tuple(
                    Turn((system if t == 0 else ()) + _tokens(rng, turn_tokens), answer_tokens)
                    for t in range(turns)
                ),
                chat=True,
            )
            for u in range(users)
        )
        return Workload(name, WORKLOADS[name], (warm, Phase(sessions)))
    if name == "rag":
        documents = [_tokens(rng, prefix_tokens) for _ in range(max(1, users // 3))]
        sessions = tuple(
            Session(
                f"ask-{u}-{t}",
                (Turn(documents[(u + t) % len(documents)] + _tokens(rng, turn_tokens), answer_tokens),),
            )
            for t in range(turns)
            for u in range(users)
        )
        return Workload(name, WORKLOADS[name], (warm, Phase(sessions)))
    if name == "unique":
        sessions = tuple(
            Session(f"unique-{i}", (Turn(_tokens(rng, prefix_tokens + turn_tokens), answer_tokens),))
            for i in range(users * turns)
        )
        return Workload(name, WORKLOADS[name], (warm, Phase(sessions)))
    if name == "burst":
        phases = [warm]
        for r in range(turns):
            prefix = _tokens(rng, prefix_tokens)
            prime = Session(f"prime-{r}", (Turn(prefix + _tokens(rng, turn_tokens), 1),))
            phases.append(Phase((prime,), timed=False))
            burst = tuple(
                Session(f"burst-{r}-{i}", (Turn(prefix + _tokens(rng, turn_tokens), answer_tokens),))
                for i in range(users)
            )
            phases.append(Phase(burst, reset_before=True))
        return Workload(name, WORKLOADS[name], tuple(phases))
    if name == "stall":
        long_prompts = tuple(Turn(_tokens(rng, STALL_LONG * prefix_tokens), 1) for _ in range(STALL_LOADS))
        prime = Session("prime", long_prompts)
        streams = tuple(
            Session(f"{STREAM}{i}", (Turn(_tokens(rng, turn_tokens), STALL_ANSWER * answer_tokens),))
            for i in range(stall_streams(users))
        )
        loads = Session(LOAD, long_prompts, start_after_tokens=STALL_ANSWER * answer_tokens // 4)
        watched = Phase((*streams, loads), reset_before=True, all_at_once=True)
        return Workload(name, WORKLOADS[name], (warm, Phase((prime,), timed=False), watched))
    raise ValueError(f"workload: got {name!r}, expected one of {sorted(WORKLOADS)}")


def stall(records: Sequence[Record]) -> float:
    """The stall workload's figure: a decoding stream's longest wait between two streamed chunks while the
    loads run (from the first one's arrival to the last one's first token) over its mean gap per token
    before, the median over the streams; 0 when the records hold no loads or no stream decoded before
    them."""
    loads = [(r.started, r.started + r.ttft) for r in records if r.session == LOAD and r.ttft is not None]
    if not loads:
        return 0.0
    begin = min(started for started, _ in loads)
    end = max(first for _, first in loads)
    ratios = []
    for r in records:
        if not r.session.startswith(STREAM) or r.error is not None:
            continue
        before = [(at, tokens) for at, tokens in r.chunks if at < begin]
        tokens = sum(count for _, count in before[1:])
        if not tokens:
            continue
        mean = (before[-1][0] - before[0][0]) / tokens
        times = [at for at, _ in r.chunks]
        spans = [b - a for a, b in itertools.pairwise(times) if b >= begin and a <= end]
        if spans and mean > 0:
            ratios.append(max(spans) / mean)
    return statistics.median(ratios) if ratios else 0.0


WORKLOADS = {
    "chat": "multi-turn chat: each user's turns in order, a shared system prompt, the history sent each turn",
    "rag": "long shared documents (one per 3 users), each asked a new question by many users",
    "unique": "unique prompts, nothing to reuse: what the connector costs",
    "burst": "a prefix stored, the engine's own cache reset, then every user at once on that prefix",
    "stall": (
        f"up to {STALL_STREAMS} streams decoding, then {STALL_LOADS} stored long prompts one after another "
        "(vLLM's own cache reset): the streams' longest token gap while they load over their mean gap before"
    ),
}


class _Progress:
    """Tokens streamed so far by each session of a phase that does not wait for others."""

    def __init__(self, names: Sequence[str]) -> None:
        self._counts = dict.fromkeys(names, 0)
        self._cond = threading.Condition()

    def add(self, name: str, tokens: int) -> None:
        self._set(name, lambda count: count + tokens)

    def end(self, name: str) -> None:
        self._set(name, lambda _: sys.maxsize)

    def _set(self, name: str, new: Callable[[int], int]) -> None:
        with self._cond:
            if name in self._counts:
                self._counts[name] = new(self._counts[name])
                self._cond.notify_all()

    def wait(self, tokens: int) -> bool:
        """Whether every session streamed ``tokens`` within a request's timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: min(self._counts.values(), default=tokens) >= tokens, REQUEST_TIMEOUT_S
            )


def _stream(
    url: str, prompt: Sequence[int], max_tokens: int, record: Record, on_tokens: Callable[[int], None]
) -> Record:
    """One streaming greedy completion; the record filled in (or its error)."""
    parts = urlsplit(url)
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,  # every configuration generates as many tokens
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
    )
    connection = http.client.HTTPConnection(
        parts.hostname or "127.0.0.1", parts.port, timeout=REQUEST_TIMEOUT_S
    )
    ttft: float | None = None
    last = record.started
    gaps: list[float] = []
    chunks: list[tuple[float, int]] = []
    output: list[int] = []
    cached = 0
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return _failed(record, f"HTTP {response.status}: {response.read()[:200]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not isinstance(chunk, dict) or "error" in chunk:
                return _failed(record, f"the server's error: {str(chunk)[:200]}")
            usage = chunk.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached)
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or ()
                if not ids:
                    continue
                now = time.monotonic()
                if ttft is None:
                    ttft = now - record.started
                else:
                    gaps.extend([(now - last) / len(ids)] * len(ids))  # a chunk may carry several tokens
                last = now
                chunks.append((now, len(ids)))
                output.extend(int(i) for i in ids)
                on_tokens(len(ids))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return _failed(record, f"{type(exc).__name__}: {exc}")
    finally:
        connection.close()
    if ttft is None or len(output) != max_tokens:
        return _failed(record, f"{len(output)} of {max_tokens} tokens came back")
    return Record(
        record.session, record.turn, record.prompt_tokens, record.started, ttft, tuple(gaps), tuple(chunks),
        tuple(output), cached, time.monotonic(),
    )  # fmt: skip


def _failed(record: Record, why: str) -> Record:
    return Record(
        record.session, record.turn, record.prompt_tokens, record.started, ended=time.monotonic(), error=why
    )


def _run_session(url: str, session: Session, out: list[Record], progress: _Progress) -> None:
    if not progress.wait(session.start_after_tokens):
        waited = Record(session.name, 0, 0, time.monotonic())
        why = f"the sessions it waits for streamed fewer than {session.start_after_tokens} tokens"
        out.append(_failed(waited, why))
        return
    history: tuple[int, ...] = ()
    try:
        for t, turn in enumerate(session.turns):
            prompt = history + turn.tokens if session.chat else turn.tokens
            started = Record(session.name, t, len(prompt), time.monotonic())
            try:
                record = _stream(url, prompt, turn.max_tokens, started, partial(progress.add, session.name))
            except Exception as exc:  # counted as an error, never a session lost without a trace
                record = _failed(started, f"{type(exc).__name__}: {exc}")
            out.append(record)
            if record.error is not None:
                return  # the rest of the conversation depends on this answer
            history = prompt + record.output
    finally:
        progress.end(session.name)


def run_phase(url: str, phase: Phase, clients: int) -> tuple[list[Record], float]:
    """Run a phase's sessions on up to ``clients`` threads; its records and its wall time (seconds)."""
    todo: queue.SimpleQueue[Session] = queue.SimpleQueue()
    for session in phase.sessions:
        todo.put(session)
    records: list[Record] = []
    progress = _Progress([s.name for s in phase.sessions if not s.start_after_tokens])
    if not phase.all_at_once and any(s.start_after_tokens for s in phase.sessions):
        raise ValueError("a session that waits for others needs a phase that runs every session at once")

    def client() -> None:
        while True:
            try:
                session = todo.get_nowait()
            except queue.Empty:
                return
            _run_session(url, session, records, progress)

    width = len(phase.sessions) if phase.all_at_once else min(clients, len(phase.sessions))
    threads = [threading.Thread(target=client, daemon=True) for _ in range(width)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S * 10)
    return records, time.monotonic() - started
