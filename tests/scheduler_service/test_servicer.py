"""The Generate handler's own edges, with a stand-in frontend and call context: what no real call
can time exactly (a client leaving while the response's headers go out)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from common.pb import generate_pb2 as pb
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.requests import NewRequest
from scheduler_service.servicer import GenerationServicer
from tests.scheduler_service.store_helpers import new_request


class QueuedFrontend:
    """Accepts every request; its events never come; records cancels."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def submit_or_abandon(self, request: pb.GenerateRequest, abandon: Callable[[str], None]) -> NewRequest:
        return new_request("queued")

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    async def sample_events(self, request_id: str, n: int) -> AsyncIterator[Any]:
        await asyncio.Event().wait()
        yield


class LeavingClient:
    async def send_initial_metadata(self, metadata: Any) -> None:
        raise asyncio.CancelledError  # the client went away: gRPC cancels the handler here


async def test_a_client_that_leaves_as_the_headers_go_out_gets_its_request_cancelled() -> None:
    frontend = QueuedFrontend()
    servicer = GenerationServicer(frontend, SchedulerMetrics())  # type: ignore[arg-type]
    handler = servicer.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2]), LeavingClient())  # type: ignore[arg-type]
    with pytest.raises(asyncio.CancelledError):
        await anext(handler)
    async with asyncio.timeout(5):
        while not frontend.cancelled:
            await asyncio.sleep(0.01)
    assert frontend.cancelled == ["queued"]
