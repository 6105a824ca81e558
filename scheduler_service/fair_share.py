"""Tenant fairness by virtual token counters (after Sheng et al., "Fairness in Serving Large
Language Models", OSDI '24): pure logic, no I/O.

Each tenant has a counter of the service it has received: prompt and generated tokens, each
weighted, divided by the tenant's weight. Admission always serves the waiting tenant with the
smallest counter, so under saturation equal-weight tenants get equal token throughput whatever
their request rates, and a tenant that was idle comes back at the smallest active counter (the
lift happens in Redis, in the ENQUEUE script) rather than with banked credit. With one tenant
this is plain queue order. Within a tenant the queue's score (``priority``) decides.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedRequest:
    request_id: str
    tenant: str
    score: float  # the queue score: lower runs sooner within the tenant
    priority: int
    num_tokens: int  # prompt + tokens generated so far: what an executor must prefill
    expected_output: int  # output tokens still expected (the estimator's guess, else max_tokens)
    cost: float  # the tenant counter's charge on admission; 0 once charged (a re-queued request)
    arrival_ms: int = 0
    affinity: str = ""  # the executor it should join when that has room (a later sample's sample 0's)


def fair_order(
    heads: Mapping[str, Sequence[QueuedRequest]],
    counters: Mapping[str, float],
    limit: int,
    running: Mapping[str, int] | None = None,
    caps: Mapping[str, int] | None = None,
    priority_credit: float = 0.0,
) -> list[QueuedRequest]:
    """Up to ``limit`` requests in the order admission should try them.

    ``heads`` holds each waiting tenant's queue head in score order. The counters advance by each
    pick's cost as if it were admitted, so one call interleaves tenants the way successive calls
    would. A tenant at its running cap is skipped. ``priority_credit``: counter tokens one priority
    level of a tenant's head is worth, so across tenants important work goes first, while a
    tenant's lead stays bounded (by 10 levels' worth of tokens): unfairness is bounded, like aging.
    """
    running = running or {}
    caps = caps or {}
    counter = dict(counters)

    def key(tenant: str, pos: int) -> tuple[float, float, str, int]:
        head = heads[tenant][pos]
        return (counter.get(tenant, 0.0) - head.priority * priority_credit, head.score, tenant, pos)

    heap = [key(t, 0) for t, items in heads.items() if items]
    heapq.heapify(heap)
    taken: dict[str, int] = {}
    order: list[QueuedRequest] = []
    while heap and len(order) < limit:
        _, _, tenant, pos = heapq.heappop(heap)
        cap = caps.get(tenant)
        if cap is not None and running.get(tenant, 0) + taken.get(tenant, 0) >= cap:
            continue
        item = heads[tenant][pos]
        order.append(item)
        taken[tenant] = taken.get(tenant, 0) + 1
        counter[tenant] = counter.get(tenant, 0.0) + item.cost
        if pos + 1 < len(heads[tenant]):
            heapq.heappush(heap, key(tenant, pos + 1))
    return order


def admission_cost(prompt_tokens: int, expected_output: int, weight: float, prompt_w: float, output_w: float) -> float:
    """What admitting a request adds to its tenant's counter (corrected by the real output at finish)."""
    return (prompt_tokens * prompt_w + expected_output * output_w) / weight
