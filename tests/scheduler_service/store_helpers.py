"""Shared by the request-store tests: keys, a sample request, and the step calls as ExecutorLink makes them."""

from __future__ import annotations

import redis.asyncio as aioredis

from common.keys import KeySchema
from common.lifecycle import FinishReason
from common.sampling_params import SamplingParams
from scheduler_service.requests import NewRequest, TokenEvent
from scheduler_service.store import Store

KEYS = KeySchema("baton")
TTL_S = 60
ARRIVAL = 1_700_000_000_000
PROMPT = (11, 12, 13)


def new_request(request_id: str, prompt: tuple[int, ...] = PROMPT, priority: int = 5) -> NewRequest:
    return NewRequest(
        request_id=request_id,
        prompt_ids=prompt,
        params=SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=("END",)),
        priority=priority,
        tenant="acme",
        deadline_ms=0,
        arrival_ms=ARRIVAL,
    )


async def enqueue(store: Store, request_id: str, score: float = 100.0, max_pending: int = 100) -> None:
    await store.requests.enqueue(new_request(request_id), score, max_pending)


async def append(
    store: Store, request_id: str, executor_id: str, index: int, tokens: tuple[int, ...], text: str = ""
) -> int:
    """Append one token event through a pipeline, as ExecutorLink does; returns the script's result."""
    async with store.redis.pipeline(transaction=False) as pipe:
        await store.requests.append_tokens(pipe, request_id, executor_id, TokenEvent(index, tokens, text))
        results = await pipe.execute()
    return int(results[0])


async def finish(store: Store, request_id: str, executor_id: str, reason: FinishReason, error: str = "") -> int:
    async with store.redis.pipeline(transaction=False) as pipe:
        await store.requests.finish(pipe, request_id, executor_id, reason, error)
        results = await pipe.execute()
    return int(results[0])


async def tokens_of(redis: aioredis.Redis, request_id: str) -> list[str]:
    return [str(t) for t in await redis.lrange(KEYS.tokens(request_id), 0, -1)]
