"""The model engine of a fuzz run, step by step: multi-turn chats over shared prefixes with per-request
salts, chunked prefill and decode, its own prefix cache, finishes and aborts at every point, preemptions
whose blocks go to other requests at once, resets with copies in flight. Every decision comes from the
engine's seeded ``random.Random``; every call into kvcore goes through the ``Connector``."""

from __future__ import annotations

import itertools
import random

from kvcore.ids import RequestId
from kvcore_cli.fuzz.connector import Connector
from kvcore_cli.fuzz.faulty_ports import FaultyPorts
from kvcore_cli.fuzz.memory import EngineMemory
from kvcore_cli.fuzz.options import FuzzOptions
from kvcore_cli.fuzz.requests import BLOCK_TOKENS, Chat, Request, RequestBook, State
from kvcore_cli.fuzz.results import FuzzSummary
from kvcore_cli.fuzz.trace import Clock, Trace

__all__ = ["ModelEngine"]

MAX_TOKENS = 96  # no request grows past this: the engine can always hold one
MAX_LIVE = 10  # requests waiting or running at once
VOCAB = 50_000
DRAIN_STEPS = 12  # more than any job is held: every copy falls due while draining

P_NEW_CHAT = 0.5
P_ABORT = 0.06
P_PREEMPT = 0.08
P_RESET = 0.02


class ModelEngine:
    """The engine's scheduling. ``options`` say which disruptions it makes."""

    def __init__(
        self,
        rng: random.Random,
        clock: Clock,
        options: FuzzOptions,
        memory: EngineMemory,
        book: RequestBook,
        connector: Connector,
        ports: FaultyPorts,
        trace: Trace,
        summary: FuzzSummary,
    ) -> None:
        self._rng = rng
        self._clock = clock
        self._options = options
        self._memory = memory
        self._book = book
        self._connector = connector
        self._ports = ports
        self._trace = trace
        self._summary = summary
        self._epoch = 0
        self._arrivals: list[tuple[int, Request]] = []  # (the step it arrives at, the next turn of a chat)
        self._chats = itertools.count()
        self._prefixes: list[list[int]] = [
            [],
            *([rng.randrange(1, VOCAB) for _ in range(k)] for k in (9, 16, 30)),
        ]

    def run(self, steps: int) -> None:
        for step in range(steps):
            self._clock.step = step
            self._step()
        self._drain()

    def _step(self) -> None:
        """One engine step. Freed blocks are reused only after a flush (``execute(take_plan())``), and the
        forward pass reads only blocks whose loads were awaited and checked."""
        self._ports.weather(self._rng)
        self._arrive()
        self._disrupt()
        self._slide_windows()
        self._make_room()
        self._connector.flush()
        self._grow()
        self._admit()
        self._connector.flush()
        self._forward()
        self._connector.flush()
        self._finish_done()

    def _drain(self) -> None:
        """End every request, then run flushes until nothing is in flight; then nothing may be left."""
        self._ports.resume()
        for req in list(self._book.live.values()):
            self._connector.end(req, finish=req.state is State.RUNNING)
        for _ in range(DRAIN_STEPS):
            self._clock.step += 1
            self._connector.flush()
            if not self._connector.ops and not self._book.ended and not self._ports.held():
                break
        else:
            self._trace.fail(
                None,
                f"not quiescent after {DRAIN_STEPS} steps of draining: ops {sorted(self._connector.ops)} "
                f"unreported, requests {sorted(self._book.ended)} never named by take_finished",
            )
        self._connector.check_released()

    def _arrive(self) -> None:
        due = [req for step, req in self._arrivals if step <= self._clock.step]
        self._arrivals = [(step, req) for step, req in self._arrivals if step > self._clock.step]
        if self._rng.random() < P_NEW_CHAT and len(self._book.live) + len(due) < MAX_LIVE:
            salt = self._rng.choice((None, None, "alpha", "beta"))
            chat = Chat(next(self._chats), salt, self._rng.random() < 0.4, self._rng.randint(1, 4))
            due.append(self._request(chat, 0, [*self._rng.choice(self._prefixes), *self._text(1, 24)]))
        for req in due:
            self._book.add(req)
            self._summary.requests += 1

    def _request(self, chat: Chat, turn: int, tokens: list[int]) -> Request:
        rid = RequestId(f"c{chat.number}.t{turn}")
        req = Request(rid, chat, turn, self._rng.random() < 0.5, tokens, self._rng.randint(0, 8))
        req.extend_hashes()
        return req

    def _text(self, low: int, high: int) -> list[int]:
        return [self._rng.randrange(1, VOCAB) for _ in range(self._rng.randint(low, high))]

    def _disrupt(self) -> None:
        """Aborts at any point, preemptions of running requests, resets."""
        if self._book.live and self._rng.random() < P_ABORT:
            self._connector.end(self._rng.choice(list(self._book.live.values())), finish=False)
        if self._options.preempt and self._book.running and self._rng.random() < P_PREEMPT:
            self._connector.preempt(self._book.live[self._rng.choice(self._book.running)])
        if self._options.reset and self._rng.random() < P_RESET:
            self._reset()

    def _reset(self) -> None:
        """A reset as after a weight update: every request holding blocks is preempted (it recomputes
        under the new epoch; its copies in flight are fenced), then ``reset``."""
        for rid in list(self._book.running):
            self._connector.preempt(self._book.live[rid])
        self._connector.reset()
        self._epoch += 1
        self._memory.new_epoch()
        self._summary.resets += 1

    def _slide_windows(self) -> None:
        """A sliding-window model gives back, before it allocates, the blocks of running requests that no
        token they compute next sees (as vLLM does; saves of the last step have been planned)."""
        window = self._options.window
        for rid in self._book.running if window else ():
            req = self._book.live[rid]
            if req.state is State.RUNNING:  # its next token sees from token computed - window + 1 on
                first = (req.computed - window * BLOCK_TOKENS + 1) // BLOCK_TOKENS
                self._summary.given_back += self._memory.give_back_before(req, first)

    def _make_room(self) -> None:
        """Preempt the latest admitted running requests until every decode has a block for its next token."""
        while True:
            live = self._book.live
            running = [live[r] for r in self._book.running if live[r].state is State.RUNNING]
            needed = sum(1 for req in running if req.needs_block())
            if needed <= len(self._memory.free) or not running:
                return
            self._connector.preempt(running[-1])

    def _grow(self) -> None:
        for rid in self._book.running:
            req = self._book.live[rid]
            if req.state is State.RUNNING and req.needs_block():
                req.blocks.append(self._memory.take(rid, self._clock.step))

    def _admit(self) -> None:
        """Admit waiting requests in order while blocks last: engine prefix hit, lookup, allocation, load."""
        for rid in list(self._book.waiting):
            req = self._book.live[rid]
            local = self._memory.prefix_hits(req)
            hits = self._connector.lookup(req, local * BLOCK_TOKENS)
            if hits is None:
                continue  # the remote lookup is pending: ask again next step
            blocks = self._memory.allocate(req, local, self._clock.step)
            if blocks is None:
                return
            req.blocks = blocks
            req.computed = local * BLOCK_TOKENS
            req.epoch = self._epoch
            self._book.admit(req)
            if self._options.window:  # what the first token it computes sees: the hit's last window
                first = local + hits // BLOCK_TOKENS - self._options.window
                self._summary.given_back += self._memory.give_back_before(req, first)
            if hits:
                self._connector.start_load(req, local, hits)

    def _forward(self) -> None:
        """The forward pass under a token budget (chunked prefill), decode sampling one token, then saves."""
        budget = self._rng.choice((4, 8, 16, 32))
        for rid in self._book.running:
            req = self._book.live[rid]
            if req.state is not State.RUNNING or budget == 0:
                continue
            todo = min(len(req.tokens) - req.computed, budget)
            budget -= todo
            self._memory.compute(req, req.computed + todo)
            if req.computed == len(req.tokens) and req.outputs_left:
                req.tokens.append(self._rng.randrange(1, VOCAB))
                req.outputs_left -= 1
                req.extend_hashes()
            self._connector.save(req)

    def _finish_done(self) -> None:
        for rid in list(self._book.running):
            req = self._book.live[rid]
            if req.state is State.RUNNING and req.computed == len(req.tokens):
                self._connector.save(req, final=True)
                self._connector.end(req, finish=True)
                self._next_turn(req)

    def _next_turn(self, req: Request) -> None:
        """The chat goes on: a new request whose prompt is the whole conversation plus new text."""
        tokens = req.tokens + self._text(1, 12)
        if req.turn + 1 < req.chat.turns and len(tokens) + 8 <= MAX_TOKENS:
            nxt = self._request(req.chat, req.turn + 1, tokens)
            self._arrivals.append((self._clock.step + self._rng.randint(1, 4), nxt))
