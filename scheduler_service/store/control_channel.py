"""The replicas' control channel (cancels and wake-ups) over Redis pub/sub.

One server or a Sentinel-managed primary: classic PUBLISH / SUBSCRIBE. A Redis Cluster: sharded
pub/sub (SPUBLISH / SSUBSCRIBE, Redis >= 7.0), because a classic PUBLISH there is broadcast over
the cluster bus to every node, so its cost grows with the cluster; a sharded message goes only
to the shard that owns the channel's slot. redis-py's cluster pub/sub follows the channel to its
new owner after a failover or resharding; a lost connection surfaces as a RedisError, on which
the caller subscribes again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import ClusterDownError, RedisError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError

from common.redis_client import is_cluster

log = logging.getLogger(__name__)

# How long one poll of a sharded subscription waits; bounds how late a stop is noticed.
_POLL_S = 1.0
WAKE = '{"wake":1}'


class ControlChannel:
    def __init__(self, redis: aioredis.Redis, channel: str) -> None:
        self._redis = redis
        self._channel = channel
        self._sharded = is_cluster(redis)
        self._waker: asyncio.Task[None] | None = None
        self._wake_again = False

    async def publish(self, payload: str) -> None:
        if self._sharded:
            await self._redis.spublish(self._channel, payload)  # type: ignore[attr-defined]
        else:
            await self._redis.publish(self._channel, payload)

    def wake_others(self) -> None:
        """Tell the other replicas that work was queued, without waiting for Redis.

        A wake asked for while one is being sent becomes one more, sent after it, so the last
        submit always has a wake published after its enqueue; a burst of submits (a batch stream's
        64 arrive together) costs one or two publishes instead of a round trip each. A wake
        that fails is logged: the other planners re-read the queue on their own within 0.25 s.
        """
        if self._waker is not None:
            self._wake_again = True
            return
        self._waker = asyncio.create_task(self._send_wakes(), name="wake-others")

    async def _send_wakes(self) -> None:
        try:
            again = True
            while again:
                self._wake_again = False
                try:
                    await self.publish(WAKE)
                except RedisError as exc:
                    log.warning("could not wake the other replicas: %s", exc)
                again = self._wake_again
        finally:
            self._waker = None

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
