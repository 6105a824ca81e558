"""Redis connections with retry and backoff, shared by both services."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.errors import NotReady

log = logging.getLogger(__name__)
T = TypeVar("T")


def connect(url: str, max_connections: int = 512) -> aioredis.Redis:
    """A pooled client that retries transient connection errors with exponential backoff."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        max_connections=max_connections,
        health_check_interval=15,
        socket_connect_timeout=2.0,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )


async def with_redis_retry(operation: Callable[[], Awaitable[T]], give_up_s: float, what: str) -> T:
    """Run ``operation``, retrying connection errors with backoff for up to ``give_up_s`` seconds.

    This is how Baton rides out a Redis restart: callers pause instead of failing, and only an
    outage longer than ``give_up_s`` surfaces, as NotReady (UNAVAILABLE to clients).
    """
    give_up = time.monotonic() + give_up_s
    delay = 0.05
    while True:
        try:
            return await operation()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if time.monotonic() >= give_up:
                raise NotReady(f"Redis is unavailable ({what})") from exc
            log.warning("%s: Redis unavailable (%s); retrying in %.2f s", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
