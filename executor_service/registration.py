"""Registers the executor in Redis and heartbeats its latest load, so schedulers can find it."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError
from redis.typing import EncodableT, FieldT

from common.keys import KeySchema
from common.periodic import Periodic
from common.redis_client import TRANSIENT_ERRORS

log = logging.getLogger(__name__)

# KEYS: the registry, this executor's record, its prefix-cache index. ARGV: its id, its started_ms.
# A newer process registered under the same id (a restart that overlapped this stop) is left alone.
RETIRE = """
local started = redis.call('HGET', KEYS[2], 'started_ms')
if started and started ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], 'XX', 0, ARGV[1])
redis.call('DEL', KEYS[2], KEYS[3])
return 1
"""


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
        self._retire = redis.register_script(RETIRE)
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
        try:
            await self.beat()
        except TRANSIENT_ERRORS as exc:
            if isinstance(exc, AuthenticationError):  # a wrong password is no outage: say so, and stop
                raise
            # Redis is away (a restart, a failover) as this executor starts: it serves, and registers
            # with the first heartbeat that lands, as the other services ride out an outage.
            log.warning("registering failed (%s); registering with the next heartbeat that lands", exc)
            self._heartbeats.start()
            return
        self._heartbeats.start(wait_first=True)

    async def _next_beat(self) -> None:
        try:
            await self.beat()
        except RedisError as exc:  # keep serving; schedulers see a stale heartbeat meanwhile
            log.warning("heartbeat failed: %s", exc)
        except Exception:  # a defect in one beat must not end them all: the executor would be reaped
            log.exception("heartbeat failed")

    async def fall_silent(self) -> None:
        """Stop the heartbeats but stay registered: the schedulers then reap this executor as dead,
        re-queueing every request Redis still records on it and dropping its prefix-cache index, as
        for one that was killed."""
        await self._heartbeats.stop()

    async def stop(self) -> None:
        """A clean stop retires this executor: it stays in the registry, silent since forever, so
        the next scheduler round reaps it (re-queueing whatever Redis still records running here:
        a request whose link failed to hand it back would otherwise wait for good, as the reaper
        reads only the registry) and then drops it. Its address, load and prefix-cache index go at
        once, with the process and its cache, so nothing is placed here again."""
        await self._heartbeats.stop()
        keys = [self._keys.executors, self._keys.executor(self._id), self._keys.cached_blocks(self._id)]
        with contextlib.suppress(RedisError):
            await self._retire(keys=keys, args=[self._id, self._fields.get("started_ms", "")])
