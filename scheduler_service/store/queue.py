"""Reads of the pending queues and the scheduling state beside them (tenants' counters and running
counts, the length estimator): what admission, metrics and the fleet's gauges look at. No state
moves here (those are the Lua scripts ``RequestRecords`` runs); every read is O(log n + what it
returns)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from redis.typing import EncodableT

from common.keys import KeySchema, split_sample_id
from scheduler_service.samples import ALONE_FIELD
from scheduler_service.store import queue_scripts
from scheduler_service.store.prefix_index import CachedRuns, cached_runs

# The fields of a queued request's record that admission reads.
QUEUED_FIELDS = ("prompt_len", "priority", "est_out", "fair_cost", "arrival_ms", "tenant", ALONE_FIELD)


@dataclass(frozen=True)
class MalformedRecord:
    """A queued request whose keys Redis could not read as the schema says (admission ends it)."""

    reason: str


# What admission reads of a queued request: its fields (``queued_details``), or None once it is gone.
QueuedDetails = dict[str, str] | MalformedRecord | None


@dataclass(frozen=True)
class AdmissionView:
    """One admission round's read of the queue (``PendingQueue.admission_view``)."""

    queued: int  # requests in the pending queue
    counters: dict[str, float]  # waiting tenant -> its virtual token counter, smallest first
    heads: dict[str, list[tuple[str, float]]]  # waiting tenant -> its heads (id, score), soonest first
    details: dict[str, QueuedDetails]  # head id -> what admission needs of it
    running: dict[str, int] = field(default_factory=dict)  # tenant -> requests assigned or running
    runs: dict[str, CachedRuns] = field(default_factory=dict)  # head id -> its prompt's cached runs


def _details(
    values: Sequence[str | None],
    generated: int,
    is_sample: bool,
    first_values: Sequence[str | None] | None,
    first_generated: object,
) -> QueuedDetails:
    """A queued request's details from its record's ``QUEUED_FIELDS`` and token count, and for a
    later sample (``is_sample``) its sample 0's state and executor (None: unreadable, counted as
    gone, so its own admission ends it) and token count."""
    if values[0] is None:
        return None
    row = {k: v or "" for k, v in zip(QUEUED_FIELDS, values, strict=True)}
    row["generated"] = str(generated)
    if is_sample and not row[ALONE_FIELD]:
        state, executor = first_values if isinstance(first_values, list) else (None, None)
        row["first_state"] = state or ""
        row["first_executor"] = executor or ""
        row["first_generated"] = str(first_generated if isinstance(first_generated, int) else 0)
    return row


class PendingQueue:
    def __init__(self, redis: aioredis.Redis, keys: KeySchema) -> None:
        self._redis = redis
        self._keys = keys
        self._view = redis.register_script(queue_scripts.ADMISSION_VIEW)

    async def peek(self, count: int) -> list[tuple[str, float]]:
        """The ``count`` requests that should run soonest (lowest scores), O(log n + count)."""
        queued = cast(
            list[tuple[str, float]], await self._redis.zrange(self._keys.pending, 0, count - 1, withscores=True)
        )
        return [(m, float(s)) for m, s in queued]

    async def queued_details(self, request_ids: Sequence[str]) -> list[QueuedDetails]:
        """What admission needs of each queued request; None for one that is gone. A later sample
        of a request (``ID~k``) also gets its sample 0's ``first_state`` ("" when its record is
        gone), ``first_executor`` and ``first_generated``, read in the same round trip, unless it
        runs on its own (``samples.ALONE_FIELD``)."""
        firsts = [split_sample_id(rid)[0] if split_sample_id(rid)[1] else None for rid in request_ids]
        async with self._redis.pipeline(transaction=False) as pipe:
            for rid, first in zip(request_ids, firsts, strict=True):
                pipe.hmget(self._keys.request(rid), *QUEUED_FIELDS)
                pipe.llen(self._keys.tokens(rid))
                if first is not None:
                    pipe.hmget(self._keys.request(first), "state", "executor")
                    pipe.llen(self._keys.tokens(first))
            raw = iter(await pipe.execute(raise_on_error=False))  # one bad record must not hide the rest
        out: list[QueuedDetails] = []
        for first in firsts:
            values, generated = next(raw), next(raw)
            first_values, first_generated = (next(raw), next(raw)) if first is not None else (None, 0)
            if isinstance(values, Exception) or isinstance(generated, Exception):
                out.append(MalformedRecord(str(values if isinstance(values, Exception) else generated)))
                continue
            out.append(_details(values, generated, first is not None, first_values, first_generated))
        return out

    async def admission_view(
        self,
        most_tenants: int,
        limit: int,
        with_running: bool = False,
        prefix_executors: Sequence[str] = (),
        prefix_heads: int = 0,
        most_prefix_lookups: int = 64,
        most_prefix_names: int = 4_096,
        tie_draw: int | None = None,
        caps: Mapping[str, int] | None = None,
    ) -> AdmissionView:
        """Everything one admission round reads, in one round trip (``queue_scripts.ADMISSION_VIEW``):
        the ``most_tenants`` waiting tenants with the smallest counters, each one's
        ceil(``limit`` / tenants) + 2 heads (at most ``limit``), the heads' details as
        ``queued_details`` gives them, the tenants' running counts when ``with_running``, and for
        each tenant's first ``prefix_heads`` heads, breadth first across tenants, how much of its
        prompt each of ``prefix_executors`` caches, as ``PrefixIndex.leading_runs`` gives it:
        at most ``most_prefix_lookups`` prompts and about ``most_prefix_names`` block names looked
        up in all (a prompt is looked up whole once begun), which bounds how long the call holds
        Redis. Where more tenants than ``most_tenants`` tie at the last counter read, ``tie_draw``
        (random by default) picks which of them are read, so no name is passed over for good.
        Tenants at their running cap in ``caps`` are left out of the ``most_tenants``."""
        sets = [self._keys.cached_blocks(executor_id) for executor_id in prefix_executors]
        keys = [self._keys.tenants_waiting, self._keys.pending, self._keys.tenant_running, *sets]
        args: list[EncodableT] = [
            most_tenants,
            limit,
            self._keys.tenant_queue_prefix,
            self._keys.request(""),
            "1" if with_running else "0",
            prefix_heads if sets else 0,
            most_prefix_lookups,
            most_prefix_names,
            random.getrandbits(31) if tie_draw is None else tie_draw,
            json.dumps(dict(caps or {})),
            *QUEUED_FIELDS,
        ]
        queued, tenants, heads_raw, details_raw, running_raw, runs_raw = cast(
            list[Any], await self._view(keys=keys, args=args)
        )
        counters = {str(t): float(c) for t, c in zip(tenants[::2], tenants[1::2], strict=True)}
        heads = {
            tenant: [(str(m), float(sc)) for m, sc in zip(rows[::2], rows[1::2], strict=True)]
            for tenant, rows in zip(counters, heads_raw, strict=True)
        }
        details: dict[str, QueuedDetails] = {}
        ids = [rid for rows in heads.values() for rid, _ in rows]
        width = len(QUEUED_FIELDS)
        for rid, row in zip(ids, details_raw, strict=True):
            if row[0] == "!":
                details[rid] = MalformedRecord(str(row[1]))
                continue
            is_sample = bool(split_sample_id(rid)[1])
            first_values = row[width + 2 : width + 4] if len(row) > width + 2 else None
            first_generated = row[width + 4] if len(row) > width + 4 else 0
            details[rid] = _details(row[1 : width + 1], row[width + 1], is_sample, first_values, first_generated)
        running = {str(t): int(n) for t, n in zip(running_raw[::2], running_raw[1::2], strict=True)}
        runs = {
            str(rid): cached_runs(row, prefix_executors) for rid, row in zip(runs_raw[::2], runs_raw[1::2], strict=True)
        }
        return AdmissionView(int(queued), counters, heads, details, running, runs)

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
