"""The fleet's prefix-cache index: per executor, a set of the names of the KV blocks it holds.

Each executor reports what entered and left its prefix cache since its previous step report
(``KvCacheEvents``); its link applies those events here, in report order, and admission asks
how much of a queued prompt each executor holds (``leading_runs``). The first report of every
stream says ``cleared`` and lists everything the executor holds, so a set is rebuilt whole
whenever a link starts; one whose link ended or whose executor died is deleted, so nothing is
placed on blocks that may no longer exist.

Names are written as ``prompt_prefix.name_text`` writes them, the same text a queued request's
record keeps (see ``prompt_prefix``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.typing import EncodableT

from common.keys import KeySchema
from scheduler_service.prompt_prefix import names_text
from scheduler_service.store import prefix_scripts


@dataclass(frozen=True)
class CacheEvents:
    """What one step report says changed in its executor's prefix cache."""

    cleared: bool = False  # forget every name reported before (the first report of a stream)
    stored: tuple[int, ...] = ()  # names of blocks that entered the cache
    removed: tuple[int, ...] = ()  # names of blocks evicted from it

    @property
    def empty(self) -> bool:
        return not (self.cleared or self.stored or self.removed)


@dataclass(frozen=True)
class CachedRuns:
    """How much of one queued prompt each executor asked about holds."""

    block_size: int  # the block size the prompt's names were computed with; 0 when it has none
    blocks: dict[str, int]  # executor id -> leading blocks of the prompt it holds
    # The prompt's names of blocks 1, 2, 4, 8, ... (mark k names its first 2**k blocks): what
    # placement compares with prompts placed but not yet cached (``placement.PrefixMarks``).
    marks: tuple[str, ...] = ()


def cached_runs(row: object, executor_ids: Sequence[str]) -> CachedRuns:
    """One request's ``CachedRuns`` from the reply of ``prefix_scripts.LEADING_RUN_LIB``'s
    ``leading_run`` over ``executor_ids``' sets; a failed or empty reply holds nothing anywhere."""
    if isinstance(row, Exception) or not isinstance(row, list) or not row:
        return CachedRuns(0, {})
    count = len(executor_ids)
    block_size, runs = int(row[0]), [int(v) for v in row[1 : 1 + count]]
    marks = tuple(v.decode() if isinstance(v, bytes) else str(v) for v in row[1 + count :])
    return CachedRuns(block_size, dict(zip(executor_ids, runs, strict=True)), marks)


class PrefixIndex:
    def __init__(self, redis: aioredis.Redis, keys: KeySchema) -> None:
        self._redis = redis
        self._keys = keys
        self._apply = redis.register_script(prefix_scripts.APPLY_EVENTS)
        self._drop = redis.register_script(prefix_scripts.DROP)
        self._runs = redis.register_script(prefix_scripts.LEADING_RUNS)

    async def apply(self, executor_id: str, events: Sequence[CacheEvents], holder: str = "") -> bool:
        """Apply consecutive reports' events in order, in one call; within a report ``stored``
        goes before ``removed``, so a block named in both counts as gone (a missing name costs one
        prefill at worst; a stale one would draw requests to a block that is not there). False
        when another replica holds ``executor_id``'s lease: nothing was written."""
        args: list[EncodableT] = [holder]
        for ev in events:
            if ev.empty:
                continue
            args += ("1" if ev.cleared else "0", len(ev.stored), *names_text(ev.stored))
            args += (len(ev.removed), *names_text(ev.removed))
        if len(args) == 1:
            return True
        keys = [self._keys.cached_blocks(executor_id), self._keys.lease(executor_id)]
        return bool(await self._apply(keys=keys, args=args))

    async def drop(self, executor_id: str, holder: str = "") -> bool:
        """Forget what ``executor_id`` holds (it died, or its link ended), unless another replica
        holds its lease: then that replica's link keeps the set."""
        keys = [self._keys.cached_blocks(executor_id), self._keys.lease(executor_id)]
        return bool(await self._drop(keys=keys, args=[holder]))

    async def leading_runs(self, request_ids: Sequence[str], executor_ids: Sequence[str]) -> list[CachedRuns]:
        """For each queued request, how many of its prompt's block names from the first on each
        executor holds, and its marks (``CachedRuns.marks``), in one round trip (a script call per
        request, so no call holds Redis long). A request gone or malformed meanwhile holds nothing
        anywhere."""
        if not request_ids:
            return []
        if not executor_ids:
            return [CachedRuns(0, {}) for _ in request_ids]
        sets = [self._keys.cached_blocks(executor_id) for executor_id in executor_ids]
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                await self._runs(keys=[self._keys.request(request_id), *sets], client=pipe)
            rows = await pipe.execute(raise_on_error=False)
        return [cached_runs(row, executor_ids) for row in rows]

    async def size(self, executor_id: str) -> int:
        """How many block names the index holds for ``executor_id``."""
        return int(await self._redis.scard(self._keys.cached_blocks(executor_id)))
