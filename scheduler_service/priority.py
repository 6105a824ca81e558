"""The pending queue's score: a virtual start time, so nothing is ever re-scored.

    score = arrival_ms - priority * priority_credit_ms

Lower scores run sooner. At equal arrival a higher priority runs first; within one priority the
order is FIFO; and aging is built in: a request waits at most (max_priority - its priority) *
priority_credit_ms behind newer, more important work before its score is the lowest. The score
is fixed at enqueue time, so enqueue and admission stay O(log n) in the queue's length.
"""

from __future__ import annotations

from common.config import RequestLevelConfig


def queue_score(arrival_ms: int, priority: int, config: RequestLevelConfig) -> float:
    if not 0 <= priority <= config.max_priority:
        raise ValueError(f"priority must lie in [0, {config.max_priority}], got {priority}")
    return float(arrival_ms) - priority * config.priority_credit_ms
