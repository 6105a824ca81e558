"""The shared-prefix workload, after SGLang's ``generated-shared-prefix`` dataset.

``num_groups`` system prompts, each followed by ``prompts_per_group`` different questions: every
request of a group starts with the same ``system_prompt_len`` tokens, which a prefix cache computes
once. Ids are random like the other workloads' (first token BOS), drawn from ``seed`` alone, so Baton
and vLLM get identical token ids. The send order is a flag: shuffled across groups (as SGLang sends
them), grouped (a group's requests back to back), or round-robin (one of each group in turn).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from baton.bench.workload import BOS, TOKEN_HIGH, TOKEN_LOW, RequestSpec, check_range

ORDERS = ("shuffled", "grouped", "round-robin")


@dataclass(frozen=True)
class SharedPrefixSpec:
    """Groups of requests behind one system prompt each; lengths are tokens, ranges inclusive."""

    num_groups: int = 8
    prompts_per_group: int = 12
    system_prompt_len: int = 384  # BOS included
    question_len: tuple[int, int] = (16, 64)  # what follows the system prompt, different in every request
    output_len: tuple[int, int] = (32, 96)
    order: str = "shuffled"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_groups", "prompts_per_group", "system_prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        check_range("question_len", self.question_len)
        check_range("output_len", self.output_len)
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")

    @property
    def num_requests(self) -> int:
        return self.num_groups * self.prompts_per_group

    @property
    def input_len(self) -> tuple[int, int]:
        return (self.system_prompt_len + self.question_len[0], self.system_prompt_len + self.question_len[1])

    def build(self) -> list[RequestSpec]:
        """The requests in send order; each carries its group's index."""
        rng = random.Random(self.seed)

        def ids(count: int) -> tuple[int, ...]:
            return tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(count))

        systems = [(BOS, *ids(self.system_prompt_len - 1)) for _ in range(self.num_groups)]
        groups = [
            [
                RequestSpec((*system, *ids(rng.randint(*self.question_len))), rng.randint(*self.output_len), group=g)
                for _ in range(self.prompts_per_group)
            ]
            for g, system in enumerate(systems)
        ]
        if self.order == "round-robin":
            return [group[i] for i in range(self.prompts_per_group) for group in groups]
        specs = [spec for group in groups for spec in group]
        if self.order == "shuffled":
            rng.shuffle(specs)
        return specs


def firsts_of_groups(specs: Sequence[RequestSpec]) -> list[bool]:
    """For each request, whether it is the first of its group in send order: the one a prefix cache
    cannot help (requests without a group count as firsts)."""
    seen: set[int] = set()
    out = []
    for spec in specs:
        out.append(spec.group is None or spec.group not in seen)
        if spec.group is not None:
            seen.add(spec.group)
    return out
