"""Fleet-wide autoscaling signals, read from Redis once a second and exported as Prometheus gauges.

What an HPA or KEDA scales executors on: how long the queue has kept each priority waiting, and
how full the fleet's KV caches are. Both come from Redis (the queue, and the load each executor
heartbeats), not from this replica's own links, so every replica exports the same fleet-wide
values: aggregate them with ``max()`` in queries, never ``sum()``. Queue depth itself is
``baton:num_requests_waiting`` (ZCARD of the queue), exported by the dispatcher.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.store.fleet import FleetRegistry
from scheduler_service.store.queue import PendingQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetSnapshot:
    """One reading of the fleet, as the gauges show it."""

    # Age in seconds of the oldest queued request of each priority, over the queue's head.
    oldest_waiting_s: dict[str, float] = field(default_factory=dict)
    executors: int = 0  # live by heartbeat
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    running: int = 0  # requests running on live executors, as they last reported

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class FleetSignals:
    def __init__(
        self,
        queue: PendingQueue,
        fleet: FleetRegistry,
        metrics: SchedulerMetrics,
        executor_timeout_ms: int,
        sample: int = 1000,
    ) -> None:
        self._queue = queue
        self._fleet = fleet
        self._metrics = metrics
        self._timeout_ms = executor_timeout_ms
        # The queue is ordered by score, and a priority's oldest request leads that priority's
        # requests in it; reading the head finds the oldest of every priority present there.
        self._sample = sample

    async def read(self) -> FleetSnapshot:
        now = time.time() * 1000
        # A malformed record must not blind the fleet's gauges: admission ends it, this skips it.
        arrivals = await self._queue.head_arrivals(self._sample)
        alive = await self._fleet.alive_since(now - self._timeout_ms)
        loads = await self._fleet.loads(alive) if alive else []
        oldest: dict[str, float] = {}
        for priority, arrival in arrivals:
            try:
                age = max(0.0, (now - float(arrival)) / 1000)
            except ValueError:
                continue
            oldest[priority] = max(age, oldest.get(priority, 0.0))
        used = total = running = 0
        for raw in loads:
            load = json.loads(raw) if raw else {}
            used += int(load.get("kv_blocks_used", 0))
            total += int(load.get("kv_blocks_total", 0))
            running += int(load.get("num_running", 0))
        return FleetSnapshot(oldest, len(alive), used, total, running)

    def publish(self, snapshot: FleetSnapshot) -> None:
        m = self._metrics
        m.oldest_waiting.clear()  # a priority no longer queued must not keep its last age
        for priority, age in snapshot.oldest_waiting_s.items():
            m.oldest_waiting.labels(priority).set(age)
        m.fleet_executors.set(snapshot.executors)
        m.fleet_kv_usage.set(snapshot.kv_usage)
        m.fleet_running.set(snapshot.running)

    async def refresh(self) -> FleetSnapshot:
        snapshot = await self.read()
        self.publish(snapshot)
        return snapshot

    async def refresh_quietly(self) -> None:
        """``refresh``, the scheduler's periodic step: a Redis outage only leaves the gauges stale."""
        try:
            await self.refresh()
        except RedisError as exc:
            log.debug("fleet signals not refreshed: %s", exc)
