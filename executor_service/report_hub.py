"""Carries step outputs from the engine thread to whichever Run stream is attached.

Exactly one scheduler replica drives an executor at a time. When a new Run stream attaches
(the lease moved), the old stream is told to end. Outputs produced while no stream is attached
are dropped on purpose: they belong to requests the next driver re-queues from Redis (Redis,
not this process, is the record of what a client has received), and delivering them late could
mislabel the tokens of a re-admitted request.

Each step is observed (metrics) and offered to the attached stream's ``TokenBatcher`` on the
engine thread itself, so a step whose report is held never wakes the event loop's thread. On a
CPU host that thread shares the cores with the steps: a wake-up per step was a context switch per
step, taken out of the step.

A new stream's first report carries the whole prefix cache (``KvCacheEvents.cleared`` and every
name held): its scheduler may have missed any number of events while no stream, or another one,
was attached, so it rebuilds its index of this executor from that. The names are read on the
engine thread right after the step, so they agree with every event that follows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

from executor_service.engine_io import KvCacheEvents, StepOutput
from executor_service.token_batching import TokenBatcher

ReportQueue = asyncio.Queue[StepOutput | None]


def _ignore(out: StepOutput) -> None:
    pass


@dataclass(eq=False)
class _Stream:
    queue: ReportQueue
    batcher: TokenBatcher | None
    synced: bool = False  # has had its first output, with the whole prefix cache (engine thread only)


class ReportHub:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        observe: Callable[[StepOutput], None] = _ignore,
        cached_names: Callable[[], tuple[int, ...]] | None = None,
    ) -> None:
        self._loop = loop
        self._observe = observe  # called on the engine thread with every step (thread-safe metrics)
        self._cached_names = cached_names  # the prefix cache's names now; None: prefix caching is off
        # The attached stream's queue and token batcher, as one attribute: the engine thread reads
        # both in one load, so it never pairs one stream's batcher with another's queue.
        self._stream: _Stream | None = None
        self.latest: StepOutput | None = None

    def publish_threadsafe(self, out: StepOutput) -> None:
        """Called from the engine thread, once per step."""
        self.latest = out
        self._observe(out)
        stream = self._stream
        if stream is None:
            return  # nobody drives this executor: dropped (see the module's docstring)
        if not stream.synced:
            stream.synced = True
            if self._cached_names is not None:
                out = replace(out, kv_events=KvCacheEvents(cleared=True, stored=self._cached_names()))
        batcher = stream.batcher
        report = out if batcher is None else batcher.offer(out)
        if report is not None:
            self._loop.call_soon_threadsafe(self._publish, stream.queue, report)

    def _publish(self, queue: ReportQueue, report: StepOutput) -> None:
        if self._stream is not None and self._stream.queue is queue:  # not a superseded stream's
            queue.put_nowait(report)

    @property
    def attached(self) -> bool:
        return self._stream is not None

    def is_current(self, queue: ReportQueue) -> bool:
        """Whether ``queue`` is the attached stream's (not one a newer stream superseded)."""
        return self._stream is not None and self._stream.queue is queue

    def attach(self, batcher: TokenBatcher | None = None) -> ReportQueue:
        """A new stream's queue of reports; ``batcher``: its token batcher (None: every step is a report)."""
        self.end_stream()  # supersede the old stream
        queue: ReportQueue = asyncio.Queue()
        self._stream = _Stream(queue, batcher)
        return queue

    def end_stream(self) -> None:
        """End the attached stream (its Run call returns), as when another supersedes it."""
        if self._stream is not None:
            self._stream.queue.put_nowait(None)

    def detach(self, queue: ReportQueue) -> bool:
        """Detach ``queue``; True when no stream is attached any more."""
        if self._stream is not None and self._stream.queue is queue:
            self._stream = None
        return self._stream is None
