"""A client that leaves while its request waits in Baton's queue gets that request cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import openai
import pytest

from common.pb import generate_pb2 as pb
from tests.conftest import RedisServer
from tests.gateway.serving import serve_gateway
from tests.stack import Stack, stack_config, start_stack


@pytest.fixture(scope="module")
async def one_slot(redis_server: RedisServer, tiny_model_dir: Path) -> AsyncIterator[tuple[Stack, str]]:
    """A stack that runs one request at a time, already busy with a long one, and its gateway."""
    redis_server.flush()
    config = stack_config(redis_server.url, tiny_model_dir, scheduler={"batch_level": {"max_batch_size": 1}})
    stack = await start_stack(config)
    blocker = stack.stub.Generate(
        pb.GenerateRequest(
            request_id="blocker", prompt_token_ids=[1, 5, 5], params=pb.SamplingParams(max_tokens=3000, ignore_eos=True)
        )
    )
    try:
        await blocker.read()
        async with serve_gateway(stack.target) as base_url:
            yield stack, base_url
    finally:
        # End the blocker first: stopping a scheduler while a request is still generating can stall
        # Dispatcher.stop until that request's stream ends.
        await stack.stub.Cancel(pb.CancelRequest(request_id="blocker"))
        async with asyncio.timeout(10):
            while await blocker.read() is not grpc.aio.EOF:
                pass
        await stack.stop()


async def _state(stack: Stack, request_id: str) -> int:
    try:
        return (await stack.stub.GetRequest(pb.GetRequestRequest(request_id=request_id))).state
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.NOT_FOUND:
            return pb.REQUEST_STATE_UNSPECIFIED
        raise


async def _wait_state(stack: Stack, request_id: str, state: int, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while await _state(stack, request_id) != state:
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("prompts", [1, 2], ids=["one-prompt", "two-prompts"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_leaving_while_queued_cancels(one_slot: tuple[Stack, str], stream: bool, prompts: int) -> None:
    stack, base_url = one_slot
    request_id = f"queued-{'stream' if stream else 'whole'}-{prompts}"
    # A list of prompts is a Baton request per prompt: prompt i > 0 is request ID.i.
    request_ids = [request_id] + [f"{request_id}.{i}" for i in range(1, prompts)]
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
        call = asyncio.create_task(
            client.completions.create(
                model=stack.config.executor.model,
                prompt="Hi" if prompts == 1 else ["Hi"] * prompts,
                max_tokens=4,
                stream=stream,
                extra_headers={"x-baton-request-id": request_id},
            )
        )
        for rid in request_ids:
            await _wait_state(stack, rid, pb.REQUEST_STATE_QUEUED)
        if stream:
            # The answer starts once Baton has accepted the requests, while they wait in the queue.
            started = await asyncio.wait_for(call, 30)
            assert isinstance(started, openai.AsyncStream)
            await started.close()  # httpx closes the connection before any token
        else:
            call.cancel()  # httpx closes the connection: the gateway sees the disconnect before any token
            with pytest.raises(asyncio.CancelledError):
                await call
    for rid in request_ids:
        await _wait_state(stack, rid, pb.REQUEST_STATE_CANCELLED)


async def test_generate_sends_its_headers_once_accepted_before_any_token(one_slot: tuple[Stack, str]) -> None:
    """What lets the gateway start its answer while the request waits: the call's initial metadata
    names the accepted request; a refused call ends without them."""
    stack, _ = one_slot
    call = stack.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 5], params=pb.SamplingParams(max_tokens=2)))
    headers = dict(await asyncio.wait_for(call.initial_metadata(), 30))
    request_id = headers["x-baton-request-id"]
    assert await _state(stack, request_id) == pb.REQUEST_STATE_QUEUED  # the only slot is the blocker's
    call.cancel()
    await _wait_state(stack, request_id, pb.REQUEST_STATE_CANCELLED)
    refused = stack.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], params=pb.SamplingParams(top_p=2.0)))
    assert "x-baton-request-id" not in dict(await refused.initial_metadata() or ())
    assert await refused.code() == grpc.StatusCode.INVALID_ARGUMENT
