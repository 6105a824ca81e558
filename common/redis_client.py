"""Redis connections with retry and backoff, shared by both services."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


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
