"""The adaptive priority score: a virtual start time, fixed at enqueue, so nothing is re-scored.

Lower scores run sooner. For one request::

    latest   = min(deadline_ms - service_ms,                     # finish by the deadline
                   arrival_ms + ttft_target_ms - prefill_ms)     # first token by the TTFT target
             - urgency_margin_ms * (1 + urgency_load_boost * L)  # urgency, weighted by load
    start    = min(arrival_ms, latest)                           # urgent work counts as arrived earlier
    score    = start
             - priority * priority_credit_ms                     # base priority, with aging
             + need_tokens * resource_ms_per_token * (1 + resource_load_boost * L)   # resource need

``L`` is the load factor in [0, 1] (``load_factor``): 0 below ``low_load_threshold``, 1 above
``high_load_threshold``, linear between. ``need_tokens`` is the prompt plus the expected output
(the estimator's guess, else ``max_tokens``); ``service_ms`` and ``prefill_ms`` come from the
executors' measured step times. Without a deadline or TTFT target, ``start`` is the arrival.

Why this shape:
- Every term is in milliseconds of queue time, so the weights read as "how much waiting is this
  worth" and the score is comparable across requests enqueued at different times.
- Aging is built in: a request waits at most ``(max_priority - priority) * priority_credit_ms``
  plus its own resource term behind newer, more important work of its tenant, without a periodic
  re-score of the queue (``aging_bound_ms``).
- A deadline acts like earliest-deadline-first: the request counts as having arrived at the latest
  moment it can start and still make it, so it overtakes work of its priority that arrived after
  that moment. The margin grows with load because queues move slower then.
- Fairness across tenants is not in the score: each tenant has its own queue, and admission picks
  tenants by virtual token counters (``fair_share``). The score orders work within a tenant.

So enqueue is one ZADD and admission reads queue heads: both O(log n) in the queue's length.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import LoadAwareConfig, RequestLevelConfig


@dataclass(frozen=True)
class ScoreInputs:
    arrival_ms: int
    priority: int
    need_tokens: int = 0  # prompt + expected output tokens
    deadline_ms: int = 0  # epoch ms by which the request should finish; 0: none
    ttft_target_ms: float = 0.0  # ms after arrival by which its first token should come; 0: none
    service_ms: float = 0.0  # expected time from start to last token
    prefill_ms: float = 0.0  # expected time from start to first token


def load_factor(load: float, config: LoadAwareConfig) -> float:
    """0 below the low threshold, 1 above the high one, linear between."""
    low, high = config.low_load_threshold, config.high_load_threshold
    if load <= low:
        return 0.0
    if load >= high or high <= low:
        return 1.0
    return (load - low) / (high - low)


def latest_start_ms(inputs: ScoreInputs, request_level: RequestLevelConfig, lf: float, boost: float) -> float | None:
    """When the request must start to meet its deadline and TTFT target, or None if it has neither;
    never more than the margin before it arrived: a deadline it cannot meet (one close at hand with
    a long output ahead) earns no more urgency than one it just can, or a client could pull a
    request ahead of every other without limit."""
    limits: list[float] = []
    if inputs.deadline_ms:
        limits.append(inputs.deadline_ms - inputs.service_ms)
    ttft = inputs.ttft_target_ms or request_level.default_ttft_target_ms
    if ttft:
        limits.append(inputs.arrival_ms + ttft - inputs.prefill_ms)
    if not limits:
        return None
    margin = request_level.urgency_margin_ms * (1 + boost * lf)
    return max(min(limits), inputs.arrival_ms) - margin


def queue_score(
    inputs: ScoreInputs,
    request_level: RequestLevelConfig,
    load_aware: LoadAwareConfig | None = None,
    load: float = 0.0,
) -> float:
    if not 0 <= inputs.priority <= request_level.max_priority:
        raise ValueError(f"priority must lie in [0, {request_level.max_priority}], got {inputs.priority}")
    load_aware = load_aware or LoadAwareConfig()
    lf = load_factor(load, load_aware)
    resource = inputs.need_tokens * request_level.resource_ms_per_token * (1 + load_aware.resource_load_boost * lf)
    latest = latest_start_ms(inputs, request_level, lf, load_aware.urgency_load_boost)
    start = float(inputs.arrival_ms) if latest is None else min(float(inputs.arrival_ms), latest)
    return start - inputs.priority * request_level.priority_credit_ms + resource


def aging_bound_ms(
    priority: int, request_level: RequestLevelConfig, need_tokens: int = 0, load_aware: LoadAwareConfig | None = None
) -> float:
    """The most a request without a deadline or TTFT target waits behind newer work of its tenant
    that arrives after it: its priority's distance from the top, and its own resource term at full
    load (a newcomer pays a resource term too, never below 0)."""
    boost = (load_aware or LoadAwareConfig()).resource_load_boost
    resource = need_tokens * request_level.resource_ms_per_token * (1 + boost)
    return (request_level.max_priority - priority) * request_level.priority_credit_ms + resource


def shed_limit(priority: int, request_level: RequestLevelConfig) -> int:
    """Queue length at which a new request of this priority is refused: the lowest go first."""
    reserve = request_level.shed_reserve_fraction * (1 - priority / max(1, request_level.max_priority))
    return max(1, int(request_level.max_pending_requests * (1 - reserve)))
