"""Where a fuzz run is and what it did: its step (``Clock``) and its last API calls (``Trace``), which a
failed check raises as a ``FuzzFailure`` with the line that replays the run."""

from __future__ import annotations

from collections import deque
from typing import NoReturn

from kvcore_cli.fuzz.options import FuzzOptions
from kvcore_cli.fuzz.results import FuzzFailure

__all__ = ["Clock", "Trace"]


class Clock:
    """The step the run is at: when a held job falls due, and the step each call and failure is put at."""

    def __init__(self) -> None:
        self.step = 0


class Trace:
    """The last ``options.trace`` API calls, each with its step."""

    def __init__(self, seed: int, steps: int, options: FuzzOptions, clock: Clock) -> None:
        self._seed = seed
        self._steps = steps
        self._options = options
        self._clock = clock
        self._calls: deque[str] = deque(maxlen=options.trace)

    def note(self, line: str) -> None:
        self._calls.append(f"s{self._clock.step} {line}")

    def fail(self, request: str | None, detail: str) -> NoReturn:
        """A check failed at this step: raise it with the calls before it and a replay line, which runs
        the same seed and options up to this step."""
        step = self._clock.step
        steps = min(self._steps, step + 1)
        replay = " ".join(
            filter(None, ["kvcore fuzz", f"--seed {self._seed} --steps {steps}", self._options.flags()])
        )
        raise FuzzFailure(self._seed, step, request, detail, replay, self._calls)
