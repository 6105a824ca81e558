"""Carries step outputs from the engine thread to whichever Run stream is attached.

Exactly one scheduler replica drives an executor at a time. When a new Run stream attaches
(the lease moved to another replica), the old stream is told to end and the new one receives
everything not yet delivered, so no token is lost in the hand-over.
"""

from __future__ import annotations

import asyncio

from executor_service.engine_io import StepOutput


class ReportHub:
    def __init__(self, loop: asyncio.AbstractEventLoop, backlog_limit: int = 10_000) -> None:
        self._loop = loop
        self._subscriber: asyncio.Queue[StepOutput | None] | None = None
        self._backlog: list[StepOutput] = []
        self._backlog_limit = backlog_limit
        self.latest: StepOutput | None = None

    def publish_threadsafe(self, out: StepOutput) -> None:
        """Called from the engine thread."""
        self._loop.call_soon_threadsafe(self._publish, out)

    def _publish(self, out: StepOutput) -> None:
        self.latest = out
        if self._subscriber is not None:
            self._subscriber.put_nowait(out)
        elif out.tokens or out.finished or out.preempted or out.rejected:
            self._backlog.append(out)
            del self._backlog[: -self._backlog_limit]

    def attach(self) -> asyncio.Queue[StepOutput | None]:
        if self._subscriber is not None:
            self._subscriber.put_nowait(None)  # supersede the old stream
        queue: asyncio.Queue[StepOutput | None] = asyncio.Queue()
        for out in self._backlog:
            queue.put_nowait(out)
        self._backlog.clear()
        self._subscriber = queue
        return queue

    def detach(self, queue: asyncio.Queue[StepOutput | None]) -> None:
        if self._subscriber is not queue:
            return
        self._subscriber = None
        while not queue.empty():
            item = queue.get_nowait()
            if item is not None:
                self._backlog.append(item)
