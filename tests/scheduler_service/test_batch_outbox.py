"""BatchStream's outbox is bounded: a slow reader holds the followers back instead of growing it.

A pure-logic test: a stand-in frontend yields events as fast as it is asked (as a Redis stream
full of waiting tokens would), and the reader takes one message at a time, slowly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from common.config import BatonConfig
from common.config_loading import with_overrides
from common.lifecycle import FinishReason
from common.pb import generate_pb2 as pb
from scheduler_service.batch_stream import BatchStream
from scheduler_service.requests import TokenEvent
from scheduler_service.servicer import response_pb

EVENTS_PER_REQUEST = 20


@dataclass
class _Submitted:
    request_id: str
    n: int = 1
    prompt_ids: tuple[int, ...] = (1, 2, 3)


class _EagerFrontend:
    """Every request has all its events ready at once."""

    def __init__(self, config: BatonConfig) -> None:
        self.config = config
        self.produced = 0

    async def submit_or_abandon(self, msg: pb.GenerateRequest, abandon: object) -> _Submitted:
        return _Submitted(msg.request_id)

    async def sample_events(self, request_id: str, n: int) -> AsyncGenerator[tuple[int, TokenEvent], None]:
        for i in range(EVENTS_PER_REQUEST):
            self.produced += 1
            last = i == EVENTS_PER_REQUEST - 1
            yield 0, TokenEvent(i, (i,), "", FinishReason.LENGTH if last else FinishReason.NONE)


async def _requests(count: int) -> AsyncIterator[Any]:
    for i in range(count):
        yield pb.GenerateRequest(request_id=f"r{i}")


async def test_a_slow_reader_gets_bounded_messages_and_every_event() -> None:
    config = with_overrides(BatonConfig(), scheduler={"request_level": {"batch_stream_outbox_events": 3}})
    frontend = _EagerFrontend(config)

    async def response_of(request_id: str, event: TokenEvent, sample_index: int) -> pb.GenerateResponse:
        return response_pb(request_id, event, sample_index)

    stream = BatchStream(frontend, response_of, lambda request_id: None)  # type: ignore[arg-type]
    got: dict[int, list[int]] = {}
    async for message in stream.run(_requests(4)):
        assert len(message.events) <= 3
        delivered = sum(len(tokens) for tokens in got.values()) + len(message.events)
        assert frontend.produced - delivered <= 3 + 4  # the outbox, and one event in hand per follower
        for event in message.events:
            got.setdefault(event.position, []).extend(event.response.token_ids)
        await asyncio.sleep(0.001)  # a slow reader
    assert got == {position: list(range(EVENTS_PER_REQUEST)) for position in range(4)}
