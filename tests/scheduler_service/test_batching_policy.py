"""scheduler_service.batching and preemption: length-aware merging, batch timeout, victim choice."""

from __future__ import annotations

from common.config import BatchLevelConfig
from scheduler_service.batching import merge_order, should_hold
from scheduler_service.fair_share import QueuedRequest
from scheduler_service.preemption import RunningRequest, choose_victims


def req(name: str, score: float, expected: int, tenant: str = "t") -> QueuedRequest:
    return QueuedRequest(name, tenant, score, 5, 32, expected, 1.0)


def test_merge_prefers_lengths_that_fit_the_batch_within_the_window() -> None:
    ordered = [req("head", 0, 500), req("long", 10, 400), req("short", 20, 30), req("far", 10_000, 30)]
    merged = merge_order(ordered, batch_remaining=[25, 35, 30], window_ms=500)
    assert [r.request_id for r in merged] == ["head", "short", "long", "far"]


def test_merge_never_moves_work_past_the_window_or_the_head() -> None:
    ordered = [req("head", 0, 500), req("a", 10, 400), req("b", 900, 30)]
    merged = merge_order(ordered, batch_remaining=[30], window_ms=500)
    assert [r.request_id for r in merged] == ["head", "a", "b"]
    assert merge_order(ordered, [30], window_ms=0) == ordered


def test_merge_keeps_each_tenants_turns_in_the_fair_order() -> None:
    ordered = [req("a0", 0, 4, "A"), req("b0", 5, 4, "B"), req("a1", 10, 30, "A"), req("b1", 15, 4, "B")]
    merged = merge_order(ordered, batch_remaining=[30], window_ms=500)
    assert [r.tenant for r in merged] == ["A", "B", "A", "B"]
    assert [r.request_id for r in merged] == ["a0", "b0", "a1", "b1"]
    ordered = [req("a0", 0, 4, "A"), req("b0", 5, 4, "B"), req("a1", 10, 4, "A"), req("a2", 15, 30, "A")]
    merged = merge_order(ordered, batch_remaining=[30], window_ms=500)
    assert [r.request_id for r in merged] == ["a0", "b0", "a2", "a1"]  # A's length fit, in A's slots


def test_batch_timeout_holds_an_idle_executor_at_low_load_only() -> None:
    config = BatchLevelConfig(min_batch_size=4, batch_timeout_ms=50)
    assert should_hold(running=0, waiting=2, oldest_wait_ms=10, load_factor=0.0, config=config)
    assert not should_hold(running=0, waiting=2, oldest_wait_ms=60, load_factor=0.0, config=config)  # timed out
    assert not should_hold(running=0, waiting=4, oldest_wait_ms=10, load_factor=0.0, config=config)  # full enough
    assert not should_hold(running=1, waiting=2, oldest_wait_ms=10, load_factor=0.0, config=config)  # busy
    assert not should_hold(running=0, waiting=2, oldest_wait_ms=10, load_factor=0.5, config=config)  # loaded
    assert not should_hold(running=0, waiting=1, oldest_wait_ms=0, load_factor=0.0, config=BatchLevelConfig())


RUNNING = [
    RunningRequest("low-old", 0, 0, blocks=4, generated=50),
    RunningRequest("low-new", 0, 0, blocks=4, generated=2),
    RunningRequest("mid", 5, 0, blocks=4, generated=1),
    RunningRequest("low-thrashed", 0, 2, blocks=8, generated=0),
]


def test_victims_are_least_important_then_least_progressed() -> None:
    assert choose_victims(
        10, need_blocks=4, free_blocks=0, free_slots=0, running=RUNNING, priority_gap=3, max_preemptions=2
    ) == ["low-new"]
    assert choose_victims(10, 8, 0, 0, RUNNING, 3, 2) == ["low-new", "low-old"]


def test_a_victim_a_later_larger_one_makes_unneeded_is_spared() -> None:
    small = RunningRequest("small", 0, 0, blocks=1, generated=0)
    large = RunningRequest("large", 0, 0, blocks=10, generated=5)
    assert choose_victims(10, 10, 0, 0, [small, large], 3, 2) == ["large"]  # greedy alone took both
    assert choose_victims(10, 11, 0, 0, [small, large], 3, 2) == ["small", "large"]  # both needed


def test_gap_and_thrash_guard_limit_preemption() -> None:
    assert choose_victims(2, 4, 0, 0, RUNNING, priority_gap=3, max_preemptions=2) == []  # gap too small
    only_thrashed = [RUNNING[3]]
    assert choose_victims(10, 4, 0, 0, only_thrashed, 3, max_preemptions=2) == []  # preempted twice already
    assert choose_victims(10, 4, 0, 0, RUNNING, priority_gap=0, max_preemptions=2) == []  # disabled


def test_no_victims_when_even_all_allowed_ones_do_not_make_room() -> None:
    assert (
        choose_victims(
            10, need_blocks=100, free_blocks=0, free_slots=0, running=RUNNING, priority_gap=3, max_preemptions=2
        )
        == []
    )
