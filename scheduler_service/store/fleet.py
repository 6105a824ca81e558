"""The executor fleet as Redis holds it: the registry (a sorted set of executor ids scored by their
last heartbeat, and a hash per executor with its address, model and load) and the leases that say
which scheduler replica drives which executor.

Executors write their own registry entries; the scheduler only reads them, drops the entry of an
executor it found dead, and takes, renews and releases leases (``lease_scripts.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import redis.asyncio as aioredis

from common.keys import KeySchema
from scheduler_service.store import lease_scripts


class FleetRegistry:
    def __init__(self, redis: aioredis.Redis, keys: KeySchema) -> None:
        self._redis = redis
        self._keys = keys
        self._renew = redis.register_script(lease_scripts.RENEW_LEASES)
        self._release = redis.register_script(lease_scripts.RELEASE_LEASE)

    # ---- the registry ------------------------------------------------------------------
    async def registered(self) -> list[str]:
        """Every registered executor, live or not, oldest heartbeat first."""
        return cast(list[str], await self._redis.zrange(self._keys.executors, 0, -1))

    async def count(self) -> int:
        """How many executors are registered, live or not."""
        return int(await self._redis.zcard(self._keys.executors))

    async def alive_since(self, since_ms: float) -> list[str]:
        """The executors whose last heartbeat came at or after ``since_ms``."""
        return cast(list[str], await self._redis.zrangebyscore(self._keys.executors, since_ms, "+inf"))

    async def silent_since(self, cutoff_ms: int) -> list[str]:
        """The executors whose last heartbeat came before ``cutoff_ms``."""
        return cast(list[str], await self._redis.zrangebyscore(self._keys.executors, "-inf", f"({cutoff_ms}"))

    async def retired(self, executor_id: str) -> bool:
        """Whether the executor stopped cleanly: a retired executor stays registered, silent since
        forever (its last heartbeat 0), until a scheduler drops it."""
        return await self._redis.zscore(self._keys.executors, executor_id) == 0

    async def forget(self, executor_id: str) -> None:
        """Drop a dead executor from the registry."""
        await self._redis.zrem(self._keys.executors, executor_id)

    async def address_of(self, executor_id: str) -> str | None:
        return cast(str | None, await self._redis.hget(self._keys.executor(executor_id), "address"))

    async def loads(self, executor_ids: Sequence[str]) -> list[str | None]:
        """Each executor's last heartbeat load (JSON text; None when it has none), in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for executor_id in executor_ids:
                pipe.hget(self._keys.executor(executor_id), "load")
            return cast(list[str | None], await pipe.execute())

    async def kv_capacities(self, executor_ids: Sequence[str]) -> list[tuple[int, int, int] | None]:
        """Each executor's KV cache as it registered it: (blocks, block size, sliding window in
        tokens, 0 for none); None where its record is gone or does not say."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for executor_id in executor_ids:
                pipe.hmget(self._keys.executor(executor_id), ["kv_blocks_total", "block_size", "kv_window_tokens"])
            rows = cast(list[list[str | None]], await pipe.execute())
        out: list[tuple[int, int, int] | None] = []
        for total, size, window in rows:
            if total is None or size is None or not total.isdigit() or not size.isdigit() or int(size) < 1:
                out.append(None)
            else:
                out.append((int(total), int(size), int(window) if window and window.isdigit() else 0))
        return out

    async def newest_record(self) -> dict[str, str]:
        """The record of the executor that heartbeat last ({} when none is registered)."""
        for executor_id in cast(list[str], await self._redis.zrevrange(self._keys.executors, 0, 0)):
            record = cast(dict[str, str], await self._redis.hgetall(self._keys.executor(executor_id)))
            if record:
                return record
        return {}

    # ---- leases ------------------------------------------------------------------------
    async def take_lease(self, executor_id: str, holder: str, ttl_ms: int) -> bool:
        """Lease ``executor_id`` to ``holder`` for ``ttl_ms``, if nobody holds it."""
        return bool(await self._redis.set(self._keys.lease(executor_id), holder, nx=True, px=ttl_ms))

    async def renew_leases(self, executor_ids: Sequence[str], holder: str, ttl_ms: int) -> list[int]:
        """Renew each lease ``holder`` still holds, in one call: 1 (renewed) or 0 per executor. A
        lease that lapsed and no replica took since is taken again while its executor is registered
        (``lease_scripts.RENEW_LEASES``)."""
        if not executor_ids:
            return []
        keys = [*(self._keys.lease(executor_id) for executor_id in executor_ids), self._keys.executors]
        return cast(list[int], await self._renew(keys=keys, args=[holder, ttl_ms, *executor_ids]))

    async def lease_holder(self, executor_id: str) -> str | None:
        """The replica that drives ``executor_id`` now, if any."""
        return cast(str | None, await self._redis.get(self._keys.lease(executor_id)))

    async def release_lease(self, executor_id: str, holder: str) -> None:
        """Give up the lease on ``executor_id``, if ``holder`` still holds it."""
        await self._release(keys=[self._keys.lease(executor_id)], args=[holder])
