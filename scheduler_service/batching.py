"""Which queued requests join a running batch: pure logic, no I/O.

Two rules on top of fair queue order:
- **Length-aware merging.** Requests whose scores lie within ``merge_window_ms`` of the head's
  are near-equals in the queue. Among them, those whose expected remaining length is closest to
  the batch's own go first, so a batch's members finish together. That wastes fewer batch slots
  on stragglers and frees KV blocks in larger runs. The head always stays first, and nothing
  moves by more than the window, so priority order and the aging bound hold within it. Only the
  head's tenant's requests trade places, each taking a slot that tenant already held: the fair
  interleave of tenants (``fair_share.fair_order``) is kept, slot by slot.
- **Batch timeout.** At low load an idle executor waits up to ``batch_timeout_ms`` (from the
  oldest waiting request's arrival) for ``min_batch_size`` requests before it starts a batch.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from common.config import BatchLevelConfig
from scheduler_service.fair_share import QueuedRequest


def merge_order(
    ordered: Sequence[QueuedRequest], batch_remaining: Sequence[int], window_ms: float
) -> list[QueuedRequest]:
    """``ordered`` reordered for length fit within the window.

    ``batch_remaining``: the running requests' expected remaining output tokens.
    """
    if len(ordered) < 3 or window_ms <= 0:
        return list(ordered)
    head = ordered[0]
    window = [r for r in ordered[1:] if r.tenant == head.tenant and r.score - head.score <= window_ms]
    if not window:
        return list(ordered)
    target = statistics.median(batch_remaining) if batch_remaining else head.expected_output
    chosen = {r.request_id for r in window}
    # The window's own slots, in order: pulling its members forward past another tenant's turn
    # would let one tenant take every slot that frees at once, which fairness forbids.
    slots = [i for i, r in enumerate(ordered) if r.request_id in chosen]
    fitted = sorted(window, key=lambda r: (abs(r.expected_output - target), r.score))
    merged = list(ordered)
    for slot, request in zip(slots, fitted, strict=True):
        merged[slot] = request
    return merged


def should_hold(
    running: int, waiting: int, oldest_wait_ms: float, load_factor: float, config: BatchLevelConfig
) -> bool:
    """True while an idle executor at low load should wait for a fuller first batch."""
    if config.batch_timeout_ms <= 0 or running > 0 or load_factor > 0:
        return False
    return waiting < config.min_batch_size and oldest_wait_ms < config.batch_timeout_ms
