"""Registers the executor in Redis and heartbeats its latest load, so schedulers can find it."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from common.keys import KeySchema
from common.periodic import Periodic

log = logging.getLogger(__name__)


class Registration:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: KeySchema,
        executor_id: str,
        fields: Mapping[str, str | int],
        load: Callable[[], Mapping[str, object]],
        interval_ms: int,
        timeout_ms: int,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._id = executor_id
        self._fields = dict(fields)
        self._load = load
        self._ttl_ms = timeout_ms * 4
        self._heartbeats = Periodic(self._next_beat, interval_ms / 1000, f"heartbeat of {executor_id}")

    async def beat(self) -> None:
        key = self._keys.executor(self._id)
        async with self._redis.pipeline(transaction=False) as pipe:
            mapping = cast(Mapping[FieldT, EncodableT], {**self._fields, "load": json.dumps(self._load())})
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, self._ttl_ms)
            pipe.zadd(self._keys.executors, {self._id: int(time.time() * 1000)})
            await pipe.execute()

    async def start(self) -> None:
        await self.beat()
        self._heartbeats.start(wait_first=True)

    async def _next_beat(self) -> None:
        try:
            await self.beat()
        except RedisError as exc:  # keep serving; schedulers see a stale heartbeat meanwhile
            log.warning("heartbeat failed: %s", exc)

    async def fall_silent(self) -> None:
        """Stop the heartbeats but stay registered: the schedulers then reap this executor as dead,
        re-queueing every request Redis still records on it and dropping its prefix-cache index, as
        for one that was killed."""
        await self._heartbeats.stop()

    async def stop(self) -> None:
        await self._heartbeats.stop()
        with contextlib.suppress(RedisError):
            await self._redis.zrem(self._keys.executors, self._id)
            # The fleet's index of this executor's prefix cache goes with the cache: normally its
            # scheduler's link drops it, but that replica may be gone too.
            await self._redis.delete(self._keys.executor(self._id), self._keys.cached_blocks(self._id))
