"""GenerateBatch: many requests over one stream, each message carrying every request's news.

Why: a streaming gRPC message costs about 100 µs of CPU on each side in Python on a small VM, and
``Generate`` sends one per token of each request. Measured end to end, that was most of the
scheduler's and the client's CPU. A batch client (evaluation, offline jobs, a benchmark) that
sends its requests over one stream gets all of a step's tokens in one message instead.

Each request runs exactly as under ``Generate``: it is submitted, then followed through
``Frontend.sample_events`` (which trims replays and repairs gaps, and merges a request's samples),
in a task of its own. Their events go
into one outbox, and the stream sends the whole outbox whenever it is free to send, so a client
that reads slowly gets larger messages, not a longer queue of small ones. A request that is
refused or fails gets an error event of its own; the others go on.

Both ends are bounded (``request_level.max_batch_stream_requests`` and
``batch_stream_outbox_events``): a request beyond the cap of unfinished ones is refused with
RESOURCE_EXHAUSTED before anything is queued, and a full outbox holds the followers back (their
tokens wait in Redis) until the client reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from common.grpc_errors import check_decoded, status_for
from common.lifecycle import FinishReason
from common.pb import generate_pb2 as pb
from scheduler_service.first_messages import FirstMessages
from scheduler_service.frontend import Frontend
from scheduler_service.requests import TokenEvent

log = logging.getLogger(__name__)

ResponseOf = Callable[[str, TokenEvent, int], Awaitable[pb.GenerateResponse]]  # request id, event, sample index


class BatchStream:
    """One GenerateBatch call: its requests' tasks and the outbox they share."""

    def __init__(self, frontend: Frontend, response_of: ResponseOf, abandon: Callable[[str], None]) -> None:
        self._frontend = frontend
        self._response_of = response_of
        self._abandon = abandon  # called with a request this stream leaves unfinished
        self._outbox: list[pb.BatchEvent] = []
        self._news = asyncio.Event()
        self._room = asyncio.Event()  # set when the outbox has been sent
        self._followers: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None
        limits = frontend.config.scheduler.request_level
        self._max_requests = limits.max_batch_stream_requests
        self._max_outbox = limits.batch_stream_outbox_events

    async def run(self, requests: AsyncIterator[Any]) -> AsyncGenerator[pb.GenerateBatchResponse, None]:
        """The stream's messages, until the client has half-closed and every request is over."""
        reader = self._reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self._news.wait()
                self._news.clear()
                if self._outbox:
                    events, self._outbox = self._outbox, []
                    self._room.set()
                    yield pb.GenerateBatchResponse(events=events)
                if reader.done() and not self._followers and not self._outbox:
                    reader.result()  # a failed read of the client's stream fails the call
                    return
        finally:
            self.end()

    def end(self) -> None:
        """Stop reading and following: the client went away or the call failed (each follower then
        abandons its own unfinished request). Also called when the RPC ends, as ``run`` may be left
        suspended at a ``yield`` by a cancel that landed while its message was being sent."""
        if self._reader is not None:
            self._reader.cancel()
        for task in list(self._followers):
            task.cancel()

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        try:
            position = 0
            async for msg in requests:
                if len(self._followers) >= self._max_requests:
                    message = f"this stream already has {self._max_requests} unfinished requests; wait for one to end"
                    await self._post(
                        pb.BatchEvent(
                            position=position,
                            error_code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                            error_message=message,
                        )
                    )
                else:
                    task = asyncio.create_task(self._follow(position, msg))
                    self._followers.add(task)
                position += 1
        finally:
            self._news.set()

    async def _follow(self, position: int, msg: Any) -> None:
        request_id, unfinished = "", 0
        try:
            check_decoded(msg)
            req = await self._frontend.submit_or_abandon(msg, self._abandon)
            request_id, unfinished = req.request_id, req.n
            first = FirstMessages(req.prompt_ids, msg.return_prompt_token_ids)  # as Generate streams it
            async with contextlib.aclosing(self._frontend.sample_events(request_id, req.n)) as events:
                async for k, event in events:
                    unfinished -= event.finish_reason is not FinishReason.NONE
                    response = first.complete(await self._response_of(request_id, event, k), k)
                    await self._post(pb.BatchEvent(position=position, response=response))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # this request's failure, told to the client; the others go on
            code, message = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("request at position %d of a batch stream failed", position, exc_info=exc)
            await self._post(pb.BatchEvent(position=position, error_code=code.value[0], error_message=message))
        finally:
            if request_id and unfinished:
                self._abandon(request_id)
            self._followers.discard(asyncio.current_task())  # type: ignore[arg-type]
            self._news.set()

    async def _post(self, event: pb.BatchEvent) -> None:
        """Add ``event`` to the outbox, first waiting while it is full (a slow reader)."""
        while len(self._outbox) >= self._max_outbox:  # every waiter wakes at once: check again
            self._room.clear()
            await self._room.wait()
        self._outbox.append(event)
        self._news.set()
