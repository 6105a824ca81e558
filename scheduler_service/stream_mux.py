"""One blocking XREAD for every token stream this replica's clients are following.

Why: each streaming client used to hold an XREAD BLOCK of its own, so every executor step cost a
Redis round trip per running request (command, reply parse, a pooled connection per client).
Profiled end to end, that was about a quarter of the scheduler's CPU, and the scheduler shares
the machine with the executor. Here one reader task asks for all followed streams at once and
hands each waiting client the entries after its own position. What a client reads is unchanged.

The read runs on a connection of its own, so a client that starts following a stream while the
read is blocked can cut it short (CLIENT UNBLOCK) instead of waiting for the next step.
A Redis Cluster spreads streams over shards, where a multi-key XREAD is refused: there each
client keeps its own read (``StreamMux.supported``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis

from common.redis_cluster import BatonRedisCluster

log = logging.getLogger(__name__)

Entry = tuple[str, dict[str, str]]


def _stream_id(entry_id: str) -> tuple[int, ...]:
    """ "1700000000000-3" -> (1700000000000, 3); "0" -> (0,): Redis orders ids this way."""
    return tuple(int(part) for part in entry_id.split("-"))


@dataclass
class _Waiter:
    after: str  # entries strictly after this id
    future: asyncio.Future[list[Entry]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class StreamMux:
    def __init__(self, redis: aioredis.Redis, block_ms: int = 250) -> None:
        self._redis = redis
        self._block_ms = block_ms
        self._waiting: dict[str, list[_Waiter]] = {}
        self._task: asyncio.Task[None] | None = None
        self._reader: aioredis.Redis | None = None
        self._reader_id: int | None = None
        self._in_flight: frozenset[str] = frozenset()  # keys the blocked XREAD covers
        self._unblocked = False  # one CLIENT UNBLOCK per blocked XREAD is enough

    @staticmethod
    def supported(redis: aioredis.Redis) -> bool:
        return not isinstance(redis, BatonRedisCluster)

    async def read(self, key: str, after: str, block_ms: int) -> list[Entry]:
        """Entries of stream ``key`` after id ``after``, waiting up to ``block_ms`` for the first."""
        waiter = _Waiter(after)
        self._waiting.setdefault(key, []).append(waiter)
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        elif key not in self._in_flight:
            await self._unblock()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), block_ms / 1000)
        except TimeoutError:
            return []
        finally:
            waiters = self._waiting.get(key, [])
            if waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiting[key]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._drop_reader()

    async def _run(self) -> None:
        try:
            while True:
                # Clients just handed entries come straight back for more: let them register
                # first, so the next read covers them all.
                for _ in range(3):
                    await asyncio.sleep(0)
                if not self._waiting:
                    return
                self._deliver(await self._read_all())
        except asyncio.CancelledError:
            await self._drop_reader()  # shutting down: give the connection back, closed
            raise
        except Exception as exc:  # the waiters' own retry logic decides what to do with it
            for waiters in self._waiting.values():
                for waiter in waiters:
                    if not waiter.future.done():
                        waiter.future.set_exception(exc)
            self._waiting.clear()
            await self._drop_reader()
        finally:
            self._task = None

    async def _read_all(self) -> list[tuple[str, list[Entry]]]:
        if self._reader is None:
            self._reader = aioredis.Redis(connection_pool=self._redis.connection_pool, single_connection_client=True)
            self._reader_id = int(await self._reader.client_id())
        streams = {key: min((w.after for w in ws), key=_stream_id) for key, ws in self._waiting.items()}
        self._in_flight, self._unblocked = frozenset(streams), False
        try:
            reply: Any = await self._reader.xread(streams, count=512, block=self._block_ms)  # type: ignore[arg-type]
        finally:
            self._in_flight = frozenset()
        if isinstance(reply, dict):  # RESP3 answers {key: entries}
            return [(key, list(entries)) for key, entries in reply.items()]
        return cast(list[tuple[str, list[Entry]]], list(reply or []))

    def _deliver(self, reply: list[tuple[str, list[Entry]]]) -> None:
        for key, entries in reply:
            still: list[_Waiter] = []
            for waiter in self._waiting.get(key, []):
                after = _stream_id(waiter.after)
                mine = [entry for entry in entries if _stream_id(entry[0]) > after]
                if mine and not waiter.future.done():
                    waiter.future.set_result(mine)
                elif not waiter.future.done():
                    still.append(waiter)
            if still:
                self._waiting[key] = still
            else:
                self._waiting.pop(key, None)

    async def _unblock(self) -> None:
        if self._unblocked or self._reader_id is None or not self._in_flight:
            return
        self._unblocked = True
        try:
            await self._redis.client_unblock(self._reader_id)
        except Exception:  # the blocked read still ends by its own timeout
            log.debug("CLIENT UNBLOCK failed", exc_info=True)

    async def _drop_reader(self) -> None:
        reader, self._reader, self._reader_id = self._reader, None, None
        if reader is not None:
            with contextlib.suppress(Exception):
                await reader.aclose()
