"""The multi-turn workload: conversations whose every turn resends the whole history.

Turn k's prompt is the conversation so far, as token ids: every earlier user message and the
tokens the model actually answered with, then turn k's new user message. So each turn's prompt
begins with the previous turn's prompt and output, the prefix a prefix cache can keep. The
messages and output lengths are drawn from ``seed``; the outputs come from the target, which is
why turns of one conversation run one after another.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from baton.bench.workload import BOS, TOKEN_HIGH, TOKEN_LOW, check_range


@dataclass(frozen=True)
class Conversation:
    """What the client says in one conversation; the model's side comes at run time."""

    messages: tuple[tuple[int, ...], ...]  # each turn's new user message; the first starts with BOS
    output_lens: tuple[int, ...]  # tokens each turn asks for

    @property
    def turns(self) -> int:
        return len(self.messages)


@dataclass(frozen=True)
class MultiTurnSpec:
    """``conversations`` conversations of ``turns`` turns; lengths are tokens, ranges inclusive."""

    conversations: int = 8
    turns: int = 4
    user_len: tuple[int, int] = (32, 64)  # each turn's new user message
    output_len: tuple[int, int] = (16, 48)  # each turn's answer
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 1:
            raise ValueError(f"conversations and turns must be at least 1, got {self.conversations}, {self.turns}")
        check_range("user_len", self.user_len)
        check_range("output_len", self.output_len)

    @property
    def num_requests(self) -> int:
        return self.conversations * self.turns

    @property
    def input_len(self) -> tuple[int, int]:
        """The shortest first-turn prompt and the longest last-turn one."""
        longest = self.turns * self.user_len[1] + (self.turns - 1) * self.output_len[1]
        return (self.user_len[0], longest)

    def build(self) -> list[Conversation]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.conversations):
            messages = []
            for turn in range(self.turns):
                length = rng.randint(*self.user_len)
                body = tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length - (turn == 0)))
                messages.append((BOS, *body) if turn == 0 else body)
            out.append(Conversation(tuple(messages), tuple(rng.randint(*self.output_len) for _ in range(self.turns))))
        return out


def turn_prompt(messages: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The prompt of turn ``len(outputs) + 1``: message 1, output 1, ..., message k (``messages`` holds
    at least the k messages; ``outputs`` the k - 1 answers so far)."""
    turn = len(outputs)
    if turn >= len(messages):
        raise ValueError(f"{len(outputs)} outputs leave no turn of the {len(messages)} messages to prompt")
    prompt: list[int] = []
    for message, output in zip(messages[:turn], outputs, strict=True):
        prompt += [*message, *output]
    return (*prompt, *messages[turn])
