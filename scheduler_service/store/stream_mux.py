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

Streams written by a link in this same process skip the read altogether: the store tells the mux
what it just added (``published``), with the ids Redis gave the entries, and the mux hands them to
their waiters at once. Redis still holds every entry first, so readers elsewhere (another replica,
a later ``Resume``) see the same stream. A stream counts as written here from the moment a link
here takes its fresh request (``expected``) or from its newest publication, until its final
event, until its request is handed back (``released``), or until nothing was published for
``LOCAL_GRACE_S``; then the shared XREAD covers it again, so a request whose link died without a
word is still followed.

The newest few entries published here are also kept in memory (``RECENT_ENTRIES``, and a finished
stream's for ``LOCAL_GRACE_S``): a client busy writing its previous token to the network when the
next step was published comes back late, and is served from them instead of an XREAD of its own.
That XREAD was a tenth of the scheduler's CPU end to end, the largest Redis cost it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from common.redis_cluster import BatonRedisCluster

log = logging.getLogger(__name__)

Entry = tuple[str, dict[str, str]]

LOCAL_GRACE_S = 2.0
RECENT_ENTRIES = 16  # per stream written here: a late reader is rarely more than a step behind
# Waiters' timeouts are checked by one task on this tick, not by a timer per read: a streaming
# client reads once per token, and a timer each time was a real share of the replica's CPU.
EXPIRY_TICK_S = 0.1


def _stream_id(entry_id: str) -> tuple[int, ...]:
    """ "1700000000000-3" -> (1700000000000, 3); "0" -> (0,): Redis orders ids this way."""
    return tuple(int(part) for part in entry_id.split("-"))


@dataclass
class _Waiter:
    after: str  # entries strictly after this id
    deadline: float  # monotonic seconds: then it gets [] (checked every EXPIRY_TICK_S)
    future: asyncio.Future[list[Entry]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class _LocalStream:
    """A stream a link in this process writes: its newest entries, oldest first, contiguous."""

    at: float  # monotonic seconds of the newest publication
    recent: deque[Entry] = field(default_factory=lambda: deque(maxlen=RECENT_ENTRIES))
    final: bool = False

    @property
    def newest(self) -> str:
        return self.recent[-1][0] if self.recent else "0"

    def after(self, entry_id: str) -> list[Entry] | None:
        """The entries after ``entry_id``, or None if some of them are older than those kept."""
        after = _stream_id(entry_id)
        if not self.recent or _stream_id(self.recent[0][0]) > after:
            return None
        return [entry for entry in self.recent if _stream_id(entry[0]) > after]


class StreamMux:
    def __init__(self, redis: aioredis.Redis, block_ms: int = 250) -> None:
        self._redis = redis
        self._block_ms = block_ms
        self._waiting: dict[str, list[_Waiter]] = {}
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._reader: aioredis.Redis | None = None
        self._reader_id: int | None = None
        self._in_flight: frozenset[str] = frozenset()  # keys the blocked XREAD covers
        self._unblocked = False  # one CLIENT UNBLOCK per blocked XREAD is enough
        self._unblocker: asyncio.Task[None] | None = None  # held: a task nobody holds may be collected
        # Streams a link in this process writes (and finished ones, for a grace period).
        self._local: dict[str, _LocalStream] = {}

    @staticmethod
    def supported(redis: aioredis.Redis) -> bool:
        return not isinstance(redis, BatonRedisCluster)

    async def read(self, key: str, after: str, block_ms: int) -> list[Entry]:
        """Entries of stream ``key`` after id ``after``, waiting up to ``block_ms`` for the first."""
        local = self._local.get(key)
        if local is not None and _stream_id(local.newest) > _stream_id(after):
            # Published here before this reader came to wait: hand it what it missed, once.
            missed = local.after(after)
            if missed is None:  # older than what is kept here
                reply: Any = await self._redis.xread({key: after}, count=512)
                missed = _entries(reply)[0][1] if reply else []
            if missed:
                return missed
        now = time.monotonic()
        waiter = _Waiter(after, now + block_ms / 1000)
        self._waiting.setdefault(key, []).append(waiter)
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._expire_waiters())
        try:
            if not self._is_local(key, now):
                await self._follow(key)
            return await waiter.future
        finally:
            waiters = self._waiting.get(key, [])
            if waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiting[key]

    def published(self, key: str, entry_id: str, fields: dict[str, str], final: bool) -> None:
        """This process just added ``entry_id`` to stream ``key``: hand it to the waiters now."""
        now = time.monotonic()
        local = self._local.get(key)
        if local is None or local.final:
            local = self._local[key] = _LocalStream(now)
        local.recent.append((entry_id, fields))
        local.at = now
        if final:  # no more publications: kept a little for a late reader, then dropped
            local.final = True
            asyncio.get_running_loop().call_later(LOCAL_GRACE_S, self._forget_finished, key)
        if key in self._waiting:
            self._deliver([(key, [(entry_id, fields)])])

    def expected(self, key: str) -> None:
        """A link here just took ``key``'s request with nothing in its stream yet: it will be
        written here, so the shared read need not cover it meanwhile (its prefill, often most
        of a short request's life). The usual grace applies: silent for ``LOCAL_GRACE_S``, it is
        read from Redis again."""
        local = self._local.get(key)
        if local is None or local.final:
            local = self._local[key] = _LocalStream(time.monotonic())
            asyncio.get_running_loop().call_later(LOCAL_GRACE_S, self._forget_silent, key, local)

    def _forget_silent(self, key: str, expected: _LocalStream) -> None:
        """Nothing was published to an expected stream within the grace: someone else may write
        it (its executor was lost, another replica runs it), so its readers go back to the shared
        read now, not when their own wait ends."""
        if self._local.get(key) is expected and not expected.recent:
            del self._local[key]
            if key in self._waiting:
                self._cover(key)

    def released(self, key: str) -> None:
        """``key``'s request left this process's links: follow it through the shared read again."""
        if self._local.pop(key, None) is not None and key in self._waiting:
            self._cover(key)

    def _cover(self, key: str) -> None:
        """Have the shared read cover ``key``, whose waiters were left to local publications."""
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        elif self._in_flight and key not in self._in_flight:  # cut the blocked read short
            self._unblocker = asyncio.create_task(self._unblock())

    def _forget_finished(self, key: str) -> None:
        local = self._local.get(key)
        if local is not None and local.final:
            del self._local[key]

    def _is_local(self, key: str, now: float) -> bool:
        local = self._local.get(key)
        return local is not None and not local.final and now - local.at < LOCAL_GRACE_S

    async def _follow(self, key: str) -> None:
        """Make sure the shared read covers ``key``: start it, or cut a blocked one short."""
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        elif key not in self._in_flight:
            await self._unblock()

    async def close(self) -> None:
        for task in (self._task, self._ticker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._drop_reader()

    async def _expire_waiters(self) -> None:
        """Answer [] to each waiter whose wait is over; stop once nobody waits."""
        try:
            while self._waiting:
                await asyncio.sleep(EXPIRY_TICK_S)
                now = time.monotonic()
                for waiters in self._waiting.values():
                    for waiter in waiters:
                        if now >= waiter.deadline and not waiter.future.done():
                            waiter.future.set_result([])
        finally:
            self._ticker = None

    async def _run(self) -> None:
        try:
            while True:
                # Clients just handed entries come straight back for more: let them register
                # first, so the next read covers them all.
                for _ in range(3):
                    await asyncio.sleep(0)
                now = time.monotonic()
                streams = {
                    key: min((w.after for w in ws), key=_stream_id)
                    for key, ws in self._waiting.items()
                    if not self._is_local(key, now)
                }
                if not streams:
                    return  # the local ones are handed their entries; a read() starts it again
                try:
                    self._deliver(await self._read_all(streams))
                except ResponseError as exc:
                    # One key of another type fails the whole shared XREAD: fail its readers
                    # alone (their request ends FAILED), and read on for everyone else.
                    if not await self._fail_malformed(streams, exc):
                        raise
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

    async def _read_all(self, streams: dict[str, str]) -> list[tuple[str, list[Entry]]]:
        if self._reader is None:
            self._reader = aioredis.Redis(connection_pool=self._redis.connection_pool, single_connection_client=True)
            self._reader_id = int(await self._reader.client_id())
        self._in_flight, self._unblocked = frozenset(streams), False
        try:
            reply: Any = await self._reader.xread(streams, count=512, block=self._block_ms)  # type: ignore[arg-type]
        finally:
            self._in_flight = frozenset()
        return _entries(reply)

    async def _fail_malformed(self, streams: dict[str, str], exc: ResponseError) -> bool:
        """Hand ``exc`` to the readers of every key in ``streams`` that is not a stream; whether any was."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in streams:
                pipe.type(key)
            types = await pipe.execute()
        bad = [key for key, kind in zip(streams, types, strict=True) if kind not in ("stream", "none")]
        for key in bad:
            for waiter in self._waiting.pop(key, []):
                if not waiter.future.done():
                    waiter.future.set_exception(exc)
        return bool(bad)

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


def _entries(reply: Any) -> list[tuple[str, list[Entry]]]:
    if isinstance(reply, dict):  # RESP3 answers {key: entries}
        return [(key, list(entries)) for key, entries in reply.items()]
    return cast(list[tuple[str, list[Entry]]], list(reply or []))
