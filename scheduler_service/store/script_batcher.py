"""One Lua script, called by many tasks, sent as few pipelined round trips as possible.

Every executor link records each step with one script call. Fifty links made fifty separate
round trips per step interval, and on the scheduler's one core each cost about 180 µs of CPU in
redis-py (pool checkout, timeouts, a socket write and read, the reply's parsing). Pipelined, a
call costs about 43 µs. So calls are group-committed across links: calls made in one turn of the
event loop go out together as soon as it comes round, and every call made while that round trip
is in flight goes out together in the next one. Idle, that is no delay at all; busy, the cost
per call falls exactly when the replica is short of CPU.

Each caller still gets its own reply or its own error, so retries stay the caller's (a
connection error fails every call of that round trip, and each caller's retry re-sends its own).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError
from redis.typing import EncodableT, KeyT

_Call = tuple[Sequence[KeyT], Sequence[EncodableT], "asyncio.Future[Any]"]


class ScriptBatcher:
    def __init__(self, redis: aioredis.Redis, script: AsyncScript) -> None:
        self._redis = redis
        self._script = script
        self._waiting: list[_Call] = []
        self._sender: asyncio.Task[None] | None = None
        self.round_trips = 0  # for tests and benchmarks: how many round trips the calls took

    async def __call__(self, keys: Sequence[KeyT], args: Sequence[EncodableT]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((keys, args, future))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_all(), name="script-batcher")
            self._sender.add_done_callback(self._sender_done)
        return await future

    async def _send_all(self) -> None:
        batch: list[_Call] = []
        try:
            while self._waiting:
                # A caller cancelled before its call went out is not sent at all, as before batching.
                batch, self._waiting = [call for call in self._waiting if not call[2].done()], []
                if batch:
                    await self._send(batch)
        except BaseException as error:  # cancelled at shutdown, say: no caller may wait for ever
            self._fail([*batch, *self._waiting], error)
            self._waiting = []
            raise
        finally:
            self._sender = None

    def _sender_done(self, task: asyncio.Task[None]) -> None:
        """A sender cancelled before it ever ran never reached its ``try``: fail what it left waiting."""
        if self._sender is task:
            self._sender = None
        if task.cancelled() and self._sender is None:
            self._fail(self._waiting, asyncio.CancelledError())
            self._waiting = []

    @staticmethod
    def _fail(calls: list[_Call], error: BaseException) -> None:
        for _, _, future in calls:
            if future.done():
                continue
            if isinstance(error, Exception):
                future.set_exception(error)
            else:
                future.cancel()

    async def _send(self, batch: list[_Call]) -> None:
        self.round_trips += 1
        if len(batch) == 1:
            keys, args, future = batch[0]
            await self._settle(future, self._script(keys=keys, args=args))
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for keys, args, _ in batch:
                    queued = pipe.evalsha(self._script.sha, len(keys), *keys, *args)
                    if inspect.isawaitable(queued):  # Baton's cluster pipeline queues EVALSHA as a coroutine
                        await queued
                replies = await pipe.execute(raise_on_error=False)
        except Exception as error:  # the round trip failed: so did every call in it
            self._fail(batch, error)
            return
        for (keys, args, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue  # its caller gave up (cancelled) meanwhile
            if isinstance(reply, NoScriptError):  # Redis restarted or flushed its scripts
                await self._settle(future, self._script(keys=keys, args=args))  # loads it again
            elif isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    @staticmethod
    async def _settle(future: asyncio.Future[Any], call: Any) -> None:
        try:
            result = await call
        except Exception as error:
            if not future.done():
                future.set_exception(error)
            return
        if not future.done():
            future.set_result(result)
