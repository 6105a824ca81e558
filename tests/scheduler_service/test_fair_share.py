"""scheduler_service.fair_share: virtual token counters interleave tenants fairly (pure logic)."""

from __future__ import annotations

from scheduler_service.fair_share import QueuedRequest, admission_cost, fair_order


def queue(tenant: str, count: int, cost: float = 10.0, start: int = 0) -> list[QueuedRequest]:
    return [QueuedRequest(f"{tenant}{i}", tenant, float(start + i), 5, 16, 10, cost) for i in range(count)]


def test_equal_counters_alternate_tenants() -> None:
    order = fair_order({"a": queue("a", 4), "b": queue("b", 4)}, {"a": 0.0, "b": 0.0}, 6)
    assert [r.tenant for r in order] == ["a", "b", "a", "b", "a", "b"]


def test_a_tenant_with_ten_times_the_requests_gets_the_same_share() -> None:
    """Under saturation (both queues never empty in the window), each tenant gets half the tokens."""
    order = fair_order({"heavy": queue("heavy", 100), "light": queue("light", 10)}, {"heavy": 0.0, "light": 0.0}, 20)
    assert sum(r.tenant == "heavy" for r in order) == sum(r.tenant == "light" for r in order) == 10


def test_weights_split_service_in_proportion() -> None:
    gold = queue("gold", 30, cost=admission_cost(0, 10, 2.0, 0.25, 1.0))  # weight 2: half the charge
    free = queue("free", 30, cost=admission_cost(0, 10, 1.0, 0.25, 1.0))
    order = fair_order({"gold": gold, "free": free}, {}, 30)
    assert sum(r.tenant == "gold" for r in order) == 20


def test_smaller_counter_goes_first_and_catches_up() -> None:
    order = fair_order({"a": queue("a", 5), "b": queue("b", 5)}, {"a": 30.0, "b": 0.0}, 5)
    assert [r.tenant for r in order] == ["b", "b", "b", "a", "b"]


def test_running_cap_skips_a_tenant() -> None:
    order = fair_order({"a": queue("a", 5), "b": queue("b", 5)}, {}, 6, running={"a": 1}, caps={"a": 2})
    assert [r.tenant for r in order].count("a") == 1


def test_requeued_requests_cost_nothing() -> None:
    order = fair_order({"a": queue("a", 3, cost=0.0), "b": queue("b", 3)}, {}, 4)
    assert [r.tenant for r in order][:3] == ["a", "a", "a"] or [r.tenant for r in order][:4].count("a") == 3


def test_priority_credit_puts_important_work_first_within_a_bounded_lead() -> None:
    vip = [QueuedRequest(f"a{i}", "a", float(i), 10, 16, 10, 10.0) for i in range(20)]
    low = [QueuedRequest(f"b{i}", "b", float(i), 0, 16, 10, 10.0) for i in range(20)]
    order = [r.tenant for r in fair_order({"a": vip, "b": low}, {}, 20, priority_credit=5.0)]
    # 10 levels x 5 tokens = a lead of 50 counter tokens: five requests of cost 10, then turns.
    assert order[:5] == ["a"] * 5
    assert order[5] == "b"
    assert order[5:].count("a") - order[5:].count("b") in (-1, 0, 1)
