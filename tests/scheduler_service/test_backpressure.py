"""Backpressure and abandoned requests: what cannot be queued is refused, what is accepted finishes,
and a client that leaves (or whose deadline passes) frees its KV blocks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import redis.asyncio as aioredis

from common.pb import generate_pb2 as pb
from scheduler_service.priority import shed_limit
from tests.scheduler_service.test_end_to_end import _wait_blocks_freed, _wait_state, greedy, random_prompts
from tests.stack import joined_tokens, stack_config, start_stack


async def test_burst_ten_times_capacity_is_shed_and_the_rest_finishes(redis_url: str, tiny_model_dir: Path) -> None:
    config = stack_config(
        redis_url,
        tiny_model_dir,
        scheduler={"batch_level": {"max_batch_size": 2}, "request_level": {"max_pending_requests": 8}},
    )
    stack = await start_stack(config)
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    deepest = 0

    async def watch_queue() -> None:
        nonlocal deepest
        while True:
            deepest = max(deepest, int(await client.zcard("{baton}:queue:pending")))
            await asyncio.sleep(0.005)

    async def one(prompt: list[int]) -> str:
        try:
            chunks = await stack.generate(greedy(prompt, 8))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
            return "shed"
        assert len(joined_tokens(chunks)) == 8 and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        return "done"

    watcher = asyncio.create_task(watch_queue())
    try:
        outcomes = await asyncio.gather(*(one(p) for p in random_prompts(100, seed=31)))
    finally:
        watcher.cancel()
        await client.aclose()
        await stack.stop()
    # The queue (up to priority 5's shed limit) and the batch were used to the full.
    assert outcomes.count("done") >= shed_limit(5, config.scheduler.request_level) + 2
    assert outcomes.count("shed") > 0
    assert deepest <= 8  # memory stays bounded by max_pending_requests


async def test_expired_grpc_deadline_aborts_the_request(redis_url: str, tiny_model_dir: Path) -> None:
    stack = await start_stack(stack_config(redis_url, tiny_model_dir))
    try:
        call = stack.stub.Generate(greedy([1, 8, 8, 8], 3000, request_id="too-slow"), timeout=1.0)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _wait_blocks_freed(stack)
        await _wait_state(stack, "too-slow", pb.REQUEST_STATE_CANCELLED)
    finally:
        await stack.stop()
