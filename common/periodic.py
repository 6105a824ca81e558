"""A background step repeated at an interval until stopped: heartbeats, readiness probes, gauges.

Why not a ``while True`` loop stopped by ``task.cancel()``: redis-py can absorb a CancelledError
that lands inside a command (the command returns normally, redis-py#2028); measured with
redis-py 8.1, about one random cancel in three of a heartbeat's pipeline was absorbed. Such a
loop then runs on, the ``await`` on it never returns, and a graceful shutdown hangs (an executor
sat idle after SIGTERM until it was killed). Here the stop is a flag the loop checks after every
step, and the cancel only cuts the current step or wait short.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class Periodic:
    def __init__(self, step: Callable[[], Awaitable[None]], interval_s: float, name: str) -> None:
        """``step`` runs now and then every ``interval_s`` after it ends; it handles its own errors
        (one that escapes ends the loop, as it would end a plain task)."""
        self._step = step
        self._interval_s = interval_s
        self._name = name
        self._stopped = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, wait_first: bool = False) -> None:
        """Run the loop; ``wait_first``: the first step after one interval (the caller just did one)."""
        self._task = asyncio.create_task(self._run(wait_first), name=self._name)

    async def _run(self, wait_first: bool) -> None:
        if wait_first:
            await self._wait()
        while not self._stopped.is_set():
            await self._step()
            await self._wait()

    async def _wait(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), self._interval_s)

    async def stop(self) -> None:
        """End the loop and wait for it: at once if it waits, after its step's current await if it
        steps (a cancel absorbed there still ends it, by the flag)."""
        self._stopped.set()
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
