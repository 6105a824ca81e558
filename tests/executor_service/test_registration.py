"""The executor's registration against a real redis-server: its heartbeat stops whenever stopped."""

from __future__ import annotations

import asyncio
import random

from common.keys import KeySchema
from common.redis_client import connect
from executor_service.registration import Registration


async def test_stop_ends_the_heartbeat_wherever_it_lands(redis_url: str) -> None:
    """A stop landing inside a heartbeat's Redis call, where redis-py can absorb the cancel (about
    one in three did), used to leave the loop beating forever and the executor's shutdown hung."""
    redis = connect(redis_url)
    keys = KeySchema("regtest")
    rng = random.Random(0)
    try:
        for _ in range(60):
            registration = Registration(redis, keys, "e1", {"address": "x"}, lambda: {"kv": 1}, 1, 1000)
            await registration.start()
            await asyncio.sleep(rng.random() * 0.01)
            await asyncio.wait_for(registration.stop(), 2.0)
            assert await redis.zscore(keys.executors, "e1") is None
    finally:
        await redis.aclose()
