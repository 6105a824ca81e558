"""scheduler_service.priority: the adaptive score (a virtual start time; lower runs sooner)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.config import LoadAwareConfig, RequestLevelConfig
from scheduler_service.priority import ScoreInputs, aging_bound_ms, load_factor, queue_score, shed_limit

# priority_credit_ms = 1000, max_priority = 10; no resource term, so only priority and time count.
CONFIG = RequestLevelConfig(resource_ms_per_token=0.0, urgency_margin_ms=2000.0)
T0 = 1_700_000_000_000


def score(arrival: int, priority: int, config: RequestLevelConfig = CONFIG, **kw: float) -> float:
    return queue_score(ScoreInputs(arrival_ms=arrival, priority=priority, **kw), config)  # type: ignore[arg-type]


def order(requests: dict[str, tuple[int, int]], config: RequestLevelConfig = CONFIG) -> list[str]:
    """Request names in run order; each maps to (arrival_ms, priority). Ties keep insertion order."""
    return sorted(requests, key=lambda name: score(*requests[name], config))


def test_score_formula_without_deadline() -> None:
    assert score(T0, 0) == float(T0)
    assert score(T0, 5) == T0 - 5000.0
    assert score(T0, 3, RequestLevelConfig(priority_credit_ms=250, resource_ms_per_token=0)) == T0 - 750.0


def test_resource_need_adds_queue_time_and_grows_with_load() -> None:
    config = RequestLevelConfig(resource_ms_per_token=0.5)
    load_aware = LoadAwareConfig(resource_load_boost=2.0)
    inputs = ScoreInputs(arrival_ms=T0, priority=0, need_tokens=1000)
    assert queue_score(inputs, config, load_aware, load=0.0) == T0 + 500.0
    assert queue_score(inputs, config, load_aware, load=1.0) == T0 + 1500.0  # very large requests yield


def test_higher_priority_runs_first_at_equal_arrival() -> None:
    requests = {f"p{p}": (T0, p) for p in (0, 5, 10, 3, 7)}
    assert order(requests) == ["p10", "p7", "p5", "p3", "p0"]


def test_fifo_within_one_priority() -> None:
    requests = {"late": (T0 + 20, 5), "first": (T0, 5), "middle": (T0 + 1, 5)}
    assert order(requests) == ["first", "middle", "late"]


def test_higher_priority_arriving_within_the_credit_window_overtakes() -> None:
    assert order({"old-low": (T0, 0), "new-high": (T0 + 9_999, 10)}) == ["new-high", "old-low"]


def test_low_priority_beats_high_priority_arriving_after_ten_credits() -> None:
    assert order({"new-high": (T0 + 10_001, 10), "old-low": (T0, 0)}) == ["old-low", "new-high"]


def test_zero_credit_makes_the_queue_pure_fifo() -> None:
    config = RequestLevelConfig(priority_credit_ms=0, resource_ms_per_token=0)
    assert order({"b": (T0 + 1, 10), "a": (T0, 0)}, config) == ["a", "b"]


def test_near_deadline_overtakes_earlier_non_urgent_work() -> None:
    urgent = score(T0 + 3000, 0, deadline_ms=T0 + 5000, service_ms=1000)
    # latest start = deadline - service - margin (2000) = T0 + 2000, before its arrival T0 + 3000.
    assert urgent == T0 + 2000
    assert urgent < score(T0 + 2500, 0)  # ahead of work queued before it
    far = score(T0 + 3000, 0, deadline_ms=T0 + 3_600_000, service_ms=1000)
    assert far == score(T0 + 3000, 0)  # a far deadline changes nothing
    # Priority still counts on top: the urgent request keeps its priority's credit.
    assert score(T0 + 3000, 5, deadline_ms=T0 + 5000, service_ms=1000) == T0 + 2000 - 5000


def test_a_deadline_it_cannot_meet_earns_no_more_than_the_margin() -> None:
    # Due a millisecond after it arrives with 30,000 tokens to write: without the bound it counted as
    # having arrived 15 minutes before, ahead of every request of the last quarter hour.
    hopeless = score(T0, 0, deadline_ms=T0 + 1, service_ms=900_000)
    assert hopeless == T0 - 2000  # the most a deadline can pull: its margin before arrival
    assert score(T0, 0, ttft_target_ms=1, prefill_ms=60_000) == T0 - 2000


def test_ttft_target_acts_like_a_deadline_for_the_first_token() -> None:
    with_target = score(T0, 0, ttft_target_ms=500, prefill_ms=100)
    assert with_target == T0 + 500 - 100 - 2000  # arrival + target - prefill - margin
    assert with_target < score(T0 - 1000, 0)


def test_urgency_margin_grows_with_load() -> None:
    load_aware = LoadAwareConfig(urgency_load_boost=1.0)
    inputs = ScoreInputs(arrival_ms=T0, priority=0, deadline_ms=T0 + 1000)
    calm = queue_score(inputs, CONFIG, load_aware, load=0.0)
    busy = queue_score(inputs, CONFIG, load_aware, load=1.0)
    assert calm == T0 - 1000
    assert busy == calm - 2000  # the margin doubles: deadlines count more under load


@pytest.mark.parametrize(("load", "expected"), [(0.0, 0.0), (0.3, 0.0), (0.575, 0.5), (0.85, 1.0), (1.0, 1.0)])
def test_load_factor_is_linear_between_the_thresholds(load: float, expected: float) -> None:
    assert load_factor(load, LoadAwareConfig(low_load_threshold=0.3, high_load_threshold=0.85)) == pytest.approx(
        expected
    )


@pytest.mark.parametrize("priority", [-1, 11, 100])
def test_out_of_range_priority_raises(priority: int) -> None:
    with pytest.raises(ValueError, match=r"priority must lie in \[0, 10\]"):
        score(T0, priority)


def test_max_priority_comes_from_config() -> None:
    config = RequestLevelConfig(max_priority=3, default_priority=1)
    queue_score(ScoreInputs(T0, 3), config)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        queue_score(ScoreInputs(T0, 4), config)


def test_shed_limit_refuses_the_lowest_priorities_first() -> None:
    config = RequestLevelConfig(max_pending_requests=100, shed_reserve_fraction=0.2)
    assert shed_limit(0, config) == 80
    assert shed_limit(5, config) == 90
    assert shed_limit(10, config) == 100


@given(t0=st.integers(0, 2**42), credit=st.integers(0, 10**6), after=st.integers(1, 10**9), p=st.integers(0, 10))
def test_aging_bound_any_priority_beats_later_priority_ten(t0: int, credit: int, after: int, p: int) -> None:
    """A request arriving at t0 beats every priority-10 request arriving after t0 + its aging bound."""
    config = RequestLevelConfig(priority_credit_ms=float(credit), resource_ms_per_token=0)
    late_high = t0 + int(aging_bound_ms(p, config)) + after
    assert score(t0, p, config) < score(late_high, 10, config)


@given(
    t0=st.integers(0, 2**42),
    after=st.integers(1, 10**9),
    p=st.integers(0, 10),
    need=st.integers(0, 200_000),
    newcomer_need=st.integers(0, 200_000),
    loads=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_aging_bound_holds_whatever_the_sizes_and_loads(
    t0: int, after: int, p: int, need: int, newcomer_need: int, loads: tuple[float, float]
) -> None:
    """With resource terms, the bound adds the request's own at full load: a big request scored
    under load still beats every priority-10 newcomer arriving past it, small or scored idle."""
    config = RequestLevelConfig()
    load_aware = LoadAwareConfig(low_load_threshold=0.0, high_load_threshold=1.0)
    late_high = t0 + math.ceil(aging_bound_ms(p, config, need, load_aware)) + after
    waiting = queue_score(ScoreInputs(t0, p, need_tokens=need), config, load_aware, loads[0])
    newcomer = queue_score(ScoreInputs(late_high, 10, need_tokens=newcomer_need), config, load_aware, loads[1])
    assert waiting < newcomer
