"""A synthetic serving workload: multi-turn chats and agents sharing system prompts and few-shot prefixes.

Token ids are random but reproducible from the seed. Conversations take turns round-robin, as concurrent
users would, so that shared prefixes are reused across conversations and each conversation's own history
is reused by its next turn.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from attrs import frozen

__all__ = ["Turn", "conversations", "is_agent"]

VOCAB = 32_000


@frozen
class Turn:
    """One request: the whole prompt (shared prefix + history + new message) and the answer it gets;
    ``turn`` counts the conversation's turns from 1."""

    conversation: int
    turn: int
    prompt: tuple[int, ...]
    answer: tuple[int, ...]


def _text(rng: random.Random, low: int, high: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(rng.randint(low, high)))


def is_agent(conversation: int) -> bool:
    """Every third conversation is an agent (system prompt and tool descriptions), the others chats."""
    return conversation % 3 == 2


def conversations(chats: int, turns: int, seed: int) -> Iterator[Turn]:
    """Yield every turn of ``chats`` conversations of ``turns`` turns each, interleaved."""
    rng = random.Random(seed)
    systems = [_text(rng, 700, 1400) for _ in range(3)]
    few_shots = [_text(rng, 250, 600) for _ in range(4)]
    tools = [_text(rng, 600, 1000) for _ in range(2)]
    histories: list[tuple[int, ...]] = []
    for c in range(chats):
        if is_agent(c):  # system prompt + tool descriptions
            histories.append(rng.choice(systems) + rng.choice(tools))
        else:  # a chat: system prompt + maybe few-shot examples
            prefix = rng.choice(systems)
            histories.append(prefix + rng.choice(few_shots) if rng.random() < 0.6 else prefix)
    for turn in range(1, turns + 1):
        for c in range(chats):
            prompt = histories[c] + _text(rng, 30, 200)
            answer = _text(rng, 20, 150)
            histories[c] = prompt + answer
            yield Turn(c, turn, prompt, answer)
