"""Reads of the pending queues and the scheduling state beside them (tenants' counters and running
counts, the length estimator): what admission, metrics and the fleet's gauges look at. No state
moves here (those are the Lua scripts ``RequestRecords`` runs); every read is O(log n + what it
returns)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from common.keys import KeySchema, split_sample_id
from scheduler_service.samples import ALONE_FIELD


@dataclass(frozen=True)
class MalformedRecord:
    """A queued request whose keys Redis could not read as the schema says (admission ends it)."""

    reason: str


class PendingQueue:
    def __init__(self, redis: aioredis.Redis, keys: KeySchema) -> None:
        self._redis = redis
        self._keys = keys

    async def peek(self, count: int) -> list[tuple[str, float]]:
        """The ``count`` requests that should run soonest (lowest scores), O(log n + count)."""
        queued = cast(
            list[tuple[str, float]], await self._redis.zrange(self._keys.pending, 0, count - 1, withscores=True)
        )
        return [(m, float(s)) for m, s in queued]

    async def waiting_tenants(self, limit: int) -> dict[str, float]:
        """The ``limit`` waiting tenants with the smallest virtual token counters."""
        rows = await self._redis.zrange(self._keys.tenants_waiting, 0, limit - 1, withscores=True)
        return {str(t): float(c) for t, c in cast(list[tuple[str, float]], rows)}

    async def tenant_heads(self, tenants: Sequence[str], count: int) -> dict[str, list[tuple[str, float]]]:
        """Each tenant's ``count`` queued requests that should run soonest, O(T log n)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.zrange(self._keys.tenant_queue(tenant), 0, count - 1, withscores=True)
            rows = await pipe.execute()
        return {t: [(str(m), float(sc)) for m, sc in row] for t, row in zip(tenants, rows, strict=True)}

    async def queued_details(self, request_ids: Sequence[str]) -> list[dict[str, str] | MalformedRecord | None]:
        """What admission needs of each queued request; None for one that is gone. A later sample
        of a request (``ID~k``) also gets its sample 0's ``first_state`` ("" when its record is
        gone), ``first_executor`` and ``first_generated``, read in the same round trip, unless it
        runs on its own (``samples.ALONE_FIELD``)."""
        fields = ("prompt_len", "priority", "est_out", "fair_cost", "arrival_ms", "tenant", ALONE_FIELD)
        firsts = [split_sample_id(rid)[0] if split_sample_id(rid)[1] else None for rid in request_ids]
        async with self._redis.pipeline(transaction=False) as pipe:
            for rid, first in zip(request_ids, firsts, strict=True):
                pipe.hmget(self._keys.request(rid), *fields)
                pipe.llen(self._keys.tokens(rid))
                if first is not None:
                    pipe.hmget(self._keys.request(first), "state", "executor")
                    pipe.llen(self._keys.tokens(first))
            raw = iter(await pipe.execute(raise_on_error=False))  # one bad record must not hide the rest
        out: list[dict[str, str] | MalformedRecord | None] = []
        for first in firsts:
            values, generated = next(raw), next(raw)
            first_values, first_generated = (next(raw), next(raw)) if first is not None else (None, 0)
            if isinstance(values, Exception) or isinstance(generated, Exception):
                out.append(MalformedRecord(str(values if isinstance(values, Exception) else generated)))
                continue
            if values[0] is None:
                out.append(None)
                continue
            row = {k: v or "" for k, v in zip(fields, values, strict=True)}
            row["generated"] = str(generated)
            if first is not None and not row[ALONE_FIELD]:
                # Sample 0's record unreadable counts as gone: its own admission ends it.
                state, executor = first_values if isinstance(first_values, list) else (None, None)
                row["first_state"] = state or ""
                row["first_executor"] = executor or ""
                row["first_generated"] = str(first_generated if isinstance(first_generated, int) else 0)
            out.append(row)
        return out

    async def tenant_running(self) -> dict[str, int]:
        raw = cast(dict[str, str], await self._redis.hgetall(self._keys.tenant_running))
        return {t: int(n) for t, n in raw.items()}

    async def estimator_fields(self) -> dict[str, str]:
        return cast(dict[str, str], await self._redis.hgetall(self._keys.estimator))

    async def prompt_lengths(self, request_ids: Sequence[str]) -> list[int | None]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for rid in request_ids:
                pipe.hget(self._keys.request(rid), "prompt_len")
                pipe.llen(self._keys.tokens(rid))
            raw = await pipe.execute(raise_on_error=False)
        return [_length(p, n) for p, n in zip(raw[::2], raw[1::2], strict=True)]

    async def position(self, request_id: str) -> int | None:
        return cast(int | None, await self._redis.zrank(self._keys.pending, request_id))

    async def length(self) -> int:
        return int(await self._redis.zcard(self._keys.pending))

    async def classes(self, sample: int) -> dict[tuple[str, str], int]:
        """Queued requests by (priority, tenant), over the ``sample`` that run soonest."""
        ids = cast(list[str], await self._redis.zrange(self._keys.pending, 0, sample - 1))
        async with self._redis.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hmget(self._keys.request(rid), "priority", "tenant")
            rows = await pipe.execute(raise_on_error=False)
        counts: dict[tuple[str, str], int] = {}
        for row in rows:
            if isinstance(row, Exception):
                continue  # malformed: admission ends it
            priority, tenant = row
            if priority is not None:
                counts[(priority, tenant or "")] = counts.get((priority, tenant or ""), 0) + 1
        return counts

    async def head_arrivals(self, sample: int) -> list[tuple[str, str]]:
        """(priority, arrival_ms) of each of the ``sample`` requests that run soonest, as stored;
        one that ended meanwhile or is malformed is left out (admission ends a malformed one)."""
        ids = cast(list[str], await self._redis.zrange(self._keys.pending, 0, sample - 1))
        if not ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in ids:
                pipe.hmget(self._keys.request(request_id), "priority", "arrival_ms")
            rows = await pipe.execute(raise_on_error=False)
        return [
            (row[0], row[1])
            for row in rows
            if not isinstance(row, Exception) and row[0] is not None and row[1] is not None
        ]


def _length(prompt_len: object, generated: object) -> int | None:
    """A request's prompt plus output length; None when it is gone or malformed."""
    if not isinstance(prompt_len, str) or not isinstance(generated, int):
        return None
    try:
        return int(prompt_len) + generated
    except ValueError:
        return None
