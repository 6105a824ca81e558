"""What the scheduler service runs beside its API: here, forgetting tenants gone idle."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis.asyncio as aioredis

from common.keys import KeySchema
from scheduler_service.server import start_scheduler
from tests.stack import stack_config

KEYS = KeySchema()


async def test_a_running_scheduler_forgets_tenants_idle_past_the_bound(redis_url: str, tiny_model_dir: Path) -> None:
    redis = aioredis.from_url(redis_url, decode_responses=True)
    await redis.hset(KEYS.tenant_counters, mapping={"gone": 5, "fresh": 5})
    await redis.zadd(KEYS.tenants_seen, {"gone": 1})  # stamped long ago; "fresh" was never stamped
    config = stack_config(redis_url, tiny_model_dir, scheduler={"request_level": {"forget_idle_tenants_s": 60}})
    running = await start_scheduler(config)
    try:
        async with asyncio.timeout(30):
            while await redis.hexists(KEYS.tenant_counters, "gone"):
                await asyncio.sleep(0.05)
        assert await redis.hget(KEYS.tenant_counters, "fresh") == "5"
    finally:
        await running.stop()
        await redis.aclose()
