"""One malformed request record never stops planning.

A record or token list corrupted by hand (another Redis type where the schema says hash or list)
while other requests run: that request ends FAILED with a reason GetRequest returns, its stream
ends with FINISH_REASON_ERROR, ``baton:requests_malformed_total`` counts it, and every other
request is planned and served exactly as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from common.keys import KeySchema
from common.pb import generate_pb2 as pb
from common.redis_client import connect
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.scheduler_service.test_end_to_end import greedy, random_prompts
from tests.stack import Stack, eventually, joined_tokens, stack_config, start_stack

KEYS = KeySchema()
Corruption = Callable[[aioredis.Redis, str], Awaitable[object]]


async def _string_for_token_list(client: aioredis.Redis, request_id: str) -> None:
    async with client.pipeline(transaction=True) as pipe:  # no step may land in between
        pipe.delete(KEYS.tokens(request_id))
        pipe.set(KEYS.tokens(request_id), "not a list")
        await pipe.execute()


async def _string_for_record(client: aioredis.Redis, request_id: str) -> None:
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(KEYS.request(request_id))
        pipe.set(KEYS.request(request_id), "not a hash")
        await pipe.execute()


async def _set_for_stream(client: aioredis.Redis, request_id: str) -> None:
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(KEYS.output(request_id))
        pipe.sadd(KEYS.output(request_id), "not a stream")
        await pipe.execute()


async def _garbage_fields(client: aioredis.Redis, request_id: str) -> None:
    await client.hset(KEYS.request(request_id), mapping={"prompt_len": "many", "params": "{"})


def _malformed_count(stack: Stack) -> float:
    value = stack.scheduler.dispatcher.metrics.registry.get_sample_value("baton:requests_malformed_total")
    return value or 0.0


async def _ends_failed(stack: Stack, stream: asyncio.Task[list[pb.GenerateResponse]], request_id: str) -> None:
    chunks = await asyncio.wait_for(stream, 60)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_ERROR
    status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id=request_id))
    assert status.state == pb.REQUEST_STATE_FAILED
    assert "malformed" in status.error, status.error


async def _others_exact(stack: Stack, model_dir: Path, prompts: list[list[int]], started: list[asyncio.Task]) -> None:
    outputs = [joined_tokens(chunks) for chunks in await asyncio.wait_for(asyncio.gather(*started), 120)]
    model = await asyncio.to_thread(load_reference_model, model_dir)
    for i, (prompt, got) in enumerate(zip(prompts, outputs, strict=True)):
        assert_matches_reference(got, await asyncio.to_thread(reference_greedy, model, prompt, 24), f"request {i}")


@pytest.mark.parametrize(
    "corrupt", [_string_for_token_list, _string_for_record, _set_for_stream], ids=["tokens", "record", "stream"]
)
async def test_a_running_request_corrupted_by_hand_fails_alone(
    redis_url: str, tiny_model_dir: Path, corrupt: Corruption
) -> None:
    stack = await start_stack(stack_config(redis_url, tiny_model_dir))
    client = connect(redis_url)
    try:
        victim = asyncio.ensure_future(stack.generate(greedy([1, 9, 9, 9], 1500, request_id="victim")))

        async def streaming() -> bool:
            return int(await client.llen(KEYS.tokens("victim"))) >= 3

        await eventually(streaming, "the victim to stream", timeout=30)
        prompts = random_prompts(6, seed=5)
        others = [asyncio.ensure_future(stack.generate(greedy(p, 24))) for p in prompts]
        await corrupt(client, "victim")
        await _ends_failed(stack, victim, "victim")
        await _others_exact(stack, tiny_model_dir, prompts, others)
        assert _malformed_count(stack) == 1
        after = await stack.generate(greedy([1, 5, 6], 4))
        assert len(joined_tokens(after)) == 4  # planning goes on
    finally:
        await client.aclose()
        await stack.stop()


@pytest.mark.parametrize(
    "corrupt", [_string_for_token_list, _string_for_record, _garbage_fields], ids=["tokens", "record", "fields"]
)
async def test_a_queued_request_corrupted_by_hand_fails_alone(
    redis_url: str, tiny_model_dir: Path, corrupt: Corruption
) -> None:
    # One request of tenant "capped" at a time: its second stays queued while the first runs.
    config = stack_config(redis_url, tiny_model_dir, scheduler={"request_level": {"tenant_max_running": {"capped": 1}}})
    stack = await start_stack(config)
    client = connect(redis_url)
    try:
        first = greedy([1, 4, 4], 200, request_id="first")
        first.tenant = "capped"
        held = greedy([1, 4, 5], 8, request_id="held")
        held.tenant = "capped"
        running = asyncio.ensure_future(stack.generate(first))

        async def first_streams() -> bool:
            return int(await client.llen(KEYS.tokens("first"))) >= 1

        await eventually(first_streams, "the first request to stream", timeout=30)
        queued = asyncio.ensure_future(stack.generate(held))

        async def is_queued() -> bool:
            return await client.zscore(KEYS.pending, "held") is not None

        await eventually(is_queued, "the held request to queue", timeout=10)
        await corrupt(client, "held")
        prompts = random_prompts(6, seed=6)
        others = [asyncio.ensure_future(stack.generate(greedy(p, 24))) for p in prompts]
        await _ends_failed(stack, queued, "held")
        await _others_exact(stack, tiny_model_dir, prompts, others)
        assert len(joined_tokens(await asyncio.wait_for(running, 60))) == 200
        assert _malformed_count(stack) == 1
        assert await client.zscore(KEYS.pending, "held") is None
        assert await client.zcard(KEYS.tenant_queue("capped")) == 0
    finally:
        await client.aclose()
        await stack.stop()
