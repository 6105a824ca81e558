"""Serve the gateway app with uvicorn inside the test's event loop, on a free port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import grpc
import uvicorn

from gateway.app import DEFAULT_MAX_BODY_BYTES, create_app
from tests.conftest import free_port


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # leave Ctrl-C to pytest


@contextlib.asynccontextmanager
async def serve_gateway(
    target: str,
    auth_tokens: Mapping[str, str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_aliases: Sequence[str] = (),
    tool_call_parser: str = "",
    reasoning_parser: str = "",
    credentials: grpc.ChannelCredentials | None = None,
) -> AsyncIterator[str]:
    """Yields the gateway's base URL, ``http://127.0.0.1:PORT``; ``auth_tokens`` turns client auth on."""
    port = free_port()
    app = create_app(
        target,
        auth_tokens=auth_tokens,
        max_body_bytes=max_body_bytes,
        model_aliases=model_aliases,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        credentials=credentials,
    )
    server = _Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(15):
            while not server.started:
                assert not task.done(), "uvicorn exited during startup"
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)
