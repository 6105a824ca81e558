"""What a prefix cache should change: how soon the requests that repeat a prefix get their first token.

In a shared-prefix run, each group's first request (in send order) pays for its system prompt's
prefill and the repeats may find it cached; in a multi-turn run, turn 1 is its conversation's first
request and every later turn repeats the history. The figure is the ratio of the repeats' mean TTFT
to the firsts', and a prefix cache should drive it down. Its value without one is not 1: in a
shuffled shared-prefix run most firsts are in the opening burst of sends and queue behind each
other's prefill (0.44 on the tiny model with the defaults and no cache), while later multi-turn
turns carry longer prompts. So compare the ratio between runs of the same workload (cache off and
on, one target and another), not with 1.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from baton.bench.stats import RequestTiming


@dataclass(frozen=True)
class PrefixReuse:
    """Mean TTFTs of the requests that start a prefix and of those that repeat one, over completed requests."""

    first_ttft_ms: float  # mean TTFT of each group's first request
    repeat_ttft_ms: float  # mean TTFT of the other requests
    firsts: int  # completed requests behind first_ttft_ms
    repeats: int  # completed requests behind repeat_ttft_ms
    ratio: float  # repeat_ttft_ms / first_ttft_ms: what a prefix cache should drive down


def _mean_ms(timings: Sequence[RequestTiming]) -> float:
    return statistics.fmean(t.ttft * 1000 for t in timings) if timings else math.nan


def prefix_reuse(firsts: Sequence[bool], timings: Sequence[RequestTiming]) -> PrefixReuse | None:
    """``firsts[i]``: whether request ``i`` is the first of its group. None when either side has no
    completed request (a workload without repeats, or every first failed)."""
    if len(firsts) != len(timings):
        raise ValueError(f"{len(firsts)} first-of-group flags for {len(timings)} timings")
    first = [t for f, t in zip(firsts, timings, strict=True) if f and t.ok]
    repeat = [t for f, t in zip(firsts, timings, strict=True) if not f and t.ok]
    if not first or not repeat:
        return None
    first_ms, repeat_ms = _mean_ms(first), _mean_ms(repeat)
    return PrefixReuse(first_ms, repeat_ms, len(first), len(repeat), repeat_ms / first_ms)


def ttft_by_turn(conversations: Sequence[Sequence[RequestTiming]]) -> tuple[float, ...]:
    """Mean TTFT (ms) of each turn index over the conversations that completed it (NaN where none did)."""
    turns = max((len(c) for c in conversations), default=0)
    return tuple(_mean_ms([c[k] for c in conversations if len(c) > k and c[k].ok]) for k in range(turns))
