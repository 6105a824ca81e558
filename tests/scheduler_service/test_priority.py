"""scheduler_service.priority: score = arrival - priority * credit; lower runs sooner, with aging."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.config import RequestLevelConfig
from scheduler_service.priority import queue_score

CONFIG = RequestLevelConfig()  # priority_credit_ms = 1000, max_priority = 10
T0 = 1_700_000_000_000


def order(requests: dict[str, tuple[int, int]], config: RequestLevelConfig = CONFIG) -> list[str]:
    """Request names in run order; each maps to (arrival_ms, priority). Ties keep insertion order."""
    return sorted(requests, key=lambda name: queue_score(*requests[name], config))


def test_score_formula() -> None:
    assert queue_score(T0, 0, CONFIG) == float(T0)
    assert queue_score(T0, 5, CONFIG) == T0 - 5000.0
    assert queue_score(T0, 3, RequestLevelConfig(priority_credit_ms=250)) == T0 - 750.0


def test_higher_priority_runs_first_at_equal_arrival() -> None:
    requests = {f"p{p}": (T0, p) for p in (0, 5, 10, 3, 7)}
    assert order(requests) == ["p10", "p7", "p5", "p3", "p0"]


def test_fifo_within_one_priority() -> None:
    requests = {"late": (T0 + 20, 5), "first": (T0, 5), "middle": (T0 + 1, 5)}
    assert order(requests) == ["first", "middle", "late"]


def test_higher_priority_arriving_within_the_credit_window_overtakes() -> None:
    requests = {"old-low": (T0, 0), "new-high": (T0 + 9_999, 10)}
    assert order(requests) == ["new-high", "old-low"]


def test_low_priority_beats_high_priority_arriving_after_ten_credits() -> None:
    requests = {"new-high": (T0 + 10_001, 10), "old-low": (T0, 0)}
    assert order(requests) == ["old-low", "new-high"]


def test_zero_credit_makes_the_queue_pure_fifo() -> None:
    config = RequestLevelConfig(priority_credit_ms=0)
    requests = {"b": (T0 + 1, 10), "a": (T0, 0)}
    assert order(requests, config) == ["a", "b"]


@pytest.mark.parametrize("priority", [-1, 11, 100])
def test_out_of_range_priority_raises(priority: int) -> None:
    with pytest.raises(ValueError, match=r"priority must lie in \[0, 10\]"):
        queue_score(T0, priority, CONFIG)


def test_boundary_priorities_are_accepted() -> None:
    queue_score(T0, 0, CONFIG)
    queue_score(T0, 10, CONFIG)


def test_max_priority_comes_from_config() -> None:
    config = RequestLevelConfig(max_priority=3, default_priority=1)
    queue_score(T0, 3, config)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        queue_score(T0, 4, config)


@given(
    t0=st.integers(0, 2**42),
    credit=st.integers(0, 10**6),
    after=st.integers(1, 10**9),
)
def test_aging_bound_priority_zero_beats_any_later_priority_ten(t0: int, credit: int, after: int) -> None:
    """A priority-0 request arriving at t0 beats every priority-10 request arriving after t0 + 10 * credit."""
    config = RequestLevelConfig(priority_credit_ms=float(credit))
    late_high = t0 + 10 * credit + after
    assert queue_score(t0, 0, config) < queue_score(late_high, 10, config)


@given(
    t0=st.integers(0, 2**42),
    credit=st.integers(0, 10**6),
    low=st.integers(0, 10),
    high=st.integers(0, 10),
    after=st.integers(1, 10**9),
)
def test_aging_bound_holds_for_any_pair_of_priorities(t0: int, credit: int, low: int, high: int, after: int) -> None:
    """A request waits at most (its priority gap) * credit behind newer, more important work."""
    low, high = min(low, high), max(low, high)
    config = RequestLevelConfig(priority_credit_ms=float(credit))
    later = t0 + (high - low) * credit + after
    assert queue_score(t0, low, config) < queue_score(later, high, config)


@given(t=st.integers(0, 2**42), dt=st.integers(1, 10**9), p=st.integers(0, 10), credit=st.integers(0, 10**6))
def test_fifo_within_a_priority_for_any_arrivals(t: int, dt: int, p: int, credit: int) -> None:
    config = RequestLevelConfig(priority_credit_ms=float(credit))
    assert queue_score(t, p, config) < queue_score(t + dt, p, config)
