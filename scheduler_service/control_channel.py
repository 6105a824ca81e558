"""The replicas' control channel (cancels and wake-ups) over Redis pub/sub.

One server or a Sentinel-managed primary: classic PUBLISH / SUBSCRIBE. A Redis Cluster: sharded
pub/sub (SPUBLISH / SSUBSCRIBE, Redis >= 7.0), because a classic PUBLISH there is broadcast over
the cluster bus to every node, so its cost grows with the cluster; a sharded message goes only
to the shard that owns the channel's slot. redis-py's cluster pub/sub follows the channel to its
new owner after a failover or resharding; a lost connection surfaces as a RedisError, on which
the caller subscribes again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import ClusterDownError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError

from common.redis_client import is_cluster

# How long one poll of a sharded subscription waits; bounds how late a stop is noticed.
_POLL_S = 1.0


class ControlChannel:
    def __init__(self, redis: aioredis.Redis, channel: str) -> None:
        self._redis = redis
        self._channel = channel
        self._sharded = is_cluster(redis)

    async def publish(self, payload: str) -> None:
        if self._sharded:
            await self._redis.spublish(self._channel, payload)  # type: ignore[attr-defined]
        else:
            await self._redis.publish(self._channel, payload)

    async def messages(self) -> AsyncIterator[str]:
        """Every payload published from now on, until the connection is lost (a RedisError)."""
        if self._sharded:
            async for payload in self._sharded_messages():
                yield payload
            return
        async with self._redis.pubsub() as pubsub:
            await pubsub.subscribe(self._channel)
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    yield str(message["data"])

    async def _sharded_messages(self) -> AsyncIterator[str]:
        cluster = cast(Any, self._redis)
        # ClusterPubSub picks the channel's node from the slot map, which a fresh client lacks.
        await cluster.initialize()
        pubsub = cluster.pubsub()  # a redis.asyncio.cluster.ClusterPubSub
        try:
            try:
                await pubsub.ssubscribe(self._channel)
            except SlotNotCoveredError as exc:  # mid-failover; not a RedisError, so say it as one
                raise ClusterDownError(str(exc)) from exc
            while True:
                if not pubsub.node_pubsub_mapping:  # nothing left subscribed: start over
                    raise RedisConnectionError(f"sharded subscription to {self._channel} lost")
                message = await pubsub.get_sharded_message(ignore_subscribe_messages=True, timeout=_POLL_S)
                if message is not None and message.get("type") == "smessage":
                    yield str(message["data"])
        finally:
            await pubsub.aclose()
