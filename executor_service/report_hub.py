"""Carries step outputs from the engine thread to whichever Run stream is attached.

Exactly one scheduler replica drives an executor at a time. When a new Run stream attaches
(the lease moved), the old stream is told to end. Outputs produced while no stream is attached
are dropped on purpose: they belong to requests the next driver re-queues from Redis (Redis,
not this process, is the record of what a client has received), and delivering them late could
mislabel the tokens of a re-admitted request.
"""

from __future__ import annotations

import asyncio

from executor_service.engine_io import StepOutput


class ReportHub:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._subscriber: asyncio.Queue[StepOutput | None] | None = None
        self.latest: StepOutput | None = None

    def publish_threadsafe(self, out: StepOutput) -> None:
        """Called from the engine thread."""
        self._loop.call_soon_threadsafe(self._publish, out)

    def _publish(self, out: StepOutput) -> None:
        self.latest = out
        if self._subscriber is not None:
            self._subscriber.put_nowait(out)

    @property
    def attached(self) -> bool:
        return self._subscriber is not None

    def attach(self) -> asyncio.Queue[StepOutput | None]:
        if self._subscriber is not None:
            self._subscriber.put_nowait(None)  # supersede the old stream
        queue: asyncio.Queue[StepOutput | None] = asyncio.Queue()
        self._subscriber = queue
        return queue

    def detach(self, queue: asyncio.Queue[StepOutput | None]) -> bool:
        """Detach ``queue``; True when no stream is attached any more."""
        if self._subscriber is queue:
            self._subscriber = None
        return self._subscriber is None
