"""Autoscaling signals: the oldest wait per priority and the fleet's KV use, read from a real Redis."""

from __future__ import annotations

import json
import time

import pytest

from common.keys import KeySchema
from common.redis_client import connect
from common.sampling_params import SamplingParams
from scheduler_service.fleet_signals import FleetSignals
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.requests import NewRequest
from scheduler_service.store import Store


async def test_oldest_wait_by_priority_and_fleet_kv_usage(redis_url: str) -> None:
    client = connect(redis_url)
    keys = KeySchema()
    try:
        store = Store(client, keys, request_ttl_s=60)
        now = int(time.time() * 1000)
        params = SamplingParams(max_tokens=8)
        for request_id, priority, age_ms in [("a", 2, 5000), ("b", 2, 1000), ("c", 8, 3000)]:
            req = NewRequest(request_id, (1, 5), params, priority, "t", 0, now - age_ms)
            await store.requests.enqueue(req, float(now - age_ms - priority * 1000), 100)
        heartbeats = {"e1": (now, 10, 100, 3), "e2": (now, 30, 100, 4), "gone": (now - 60_000, 90, 100, 9)}
        for executor_id, (beat, used, total, running) in heartbeats.items():
            load = {"kv_blocks_used": used, "kv_blocks_total": total, "num_running": running}
            await client.hset(keys.executor(executor_id), mapping={"load": json.dumps(load)})
            await client.zadd(keys.executors, {executor_id: beat})

        metrics = SchedulerMetrics()
        signals = FleetSignals(store.queue, store.fleet, metrics, executor_timeout_ms=3000)
        snapshot = await signals.refresh()

        assert set(snapshot.oldest_waiting_s) == {"2", "8"}
        assert snapshot.oldest_waiting_s["2"] == pytest.approx(5.0, abs=1.0)
        assert snapshot.oldest_waiting_s["8"] == pytest.approx(3.0, abs=1.0)
        assert (snapshot.executors, snapshot.running) == (2, 7)  # the stale executor does not count
        assert snapshot.kv_usage == pytest.approx(0.2)
        sample = metrics.registry.get_sample_value
        assert sample("baton:queue_oldest_waiting_seconds", {"priority": "2"}) == pytest.approx(5.0, abs=1.0)
        assert sample("baton:fleet_kv_cache_usage_perc") == pytest.approx(0.2)
        assert sample("baton:fleet_num_requests_running") == 7
        assert sample("baton:fleet_executors") == 2

        for request_id in ("a", "b", "c"):
            assert await store.requests.claim(request_id, "e1") is not None
        snapshot = await signals.refresh()
        assert snapshot.oldest_waiting_s == {}
        assert sample("baton:queue_oldest_waiting_seconds", {"priority": "2"}) is None
    finally:
        await client.aclose()
