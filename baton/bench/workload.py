"""Benchmark workloads: random token-id prompts, output lengths, scenario presets and arrival times.

Prompts are random token ids (first token BOS), so a run needs no dataset and no tokenizer, and the
same seed gives the same requests everywhere (Baton, vLLM, HF). Every request asks for exactly its
output length: decoding is greedy and EOS is ignored.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.bench.multi_turn import MultiTurnSpec
    from baton.bench.shared_prefix import SharedPrefixSpec

BOS = 1
# Token ids drawn for prompts: past the special tokens, inside every generated model's vocabulary.
TOKEN_LOW, TOKEN_HIGH = 5, 8000


def check_range(name: str, span: tuple[int, int]) -> None:
    """A length range (inclusive) must be non-empty and start at 1 or more."""
    low, high = span
    if low < 1 or high < low:
        raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {low}..{high}")


@dataclass(frozen=True)
class RequestSpec:
    """One benchmark request."""

    prompt_ids: tuple[int, ...]  # starts with BOS
    output_len: int  # tokens the request asks for (max_tokens, EOS ignored)
    # Requests of one group share a prompt prefix (a system prompt, or a conversation's history);
    # None when the workload shares none. The report sets each group's first request against the rest.
    group: int | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """How many requests, and the (inclusive) ranges their prompt and output lengths are drawn from."""

    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, got {self.num_requests}")
        check_range("input_len", self.input_len)
        check_range("output_len", self.output_len)

    def build(self) -> list[RequestSpec]:
        rng = random.Random(self.seed)
        specs = []
        for _ in range(self.num_requests):
            length = rng.randint(*self.input_len)
            prompt = (BOS, *(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length - 1)))
            specs.append(RequestSpec(prompt, rng.randint(*self.output_len)))
        return specs


@dataclass(frozen=True)
class Scenario:
    """A named preset: a workload and how many requests the client keeps in flight."""

    name: str
    description: str
    workload: WorkloadSpec | SharedPrefixSpec | MultiTurnSpec
    batch_size: int  # most requests in flight at once (client-side concurrency)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("short", "short prompts and outputs (< 128 tokens each)", WorkloadSpec(256, (8, 127), (8, 64)), 64),
        Scenario("long", "long prompts (> 1024 tokens), short outputs", WorkloadSpec(32, (1025, 2048), (16, 64)), 16),
        Scenario(
            "mixed",
            "prompts 32-256, outputs 16-128 (bench/throughput.py's mix)",
            WorkloadSpec(64, (32, 256), (16, 128)),
            64,
        ),
        Scenario(
            "high-concurrency",
            "1,000 short requests all in flight at once",
            WorkloadSpec(1000, (16, 64), (8, 32)),
            1000,
        ),
    )
}


def arrival_offsets(count: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start, as ``vllm bench serve`` draws them.

    Gaps are gamma-distributed with shape ``burstiness`` and mean ``1 / request_rate``: burstiness 1
    is a Poisson process, lower is burstier, higher is more regular. An infinite rate sends all at once.
    """
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.gammavariate(burstiness, theta)
    return offsets
