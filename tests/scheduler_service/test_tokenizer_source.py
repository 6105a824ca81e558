"""``TokenizerSource``: the tokenizer and limits come from what an executor registered in Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from common.errors import NotReady
from common.keys import KeySchema
from scheduler_service.store.fleet import FleetRegistry
from scheduler_service.tokenizer_source import TokenizerSource


async def test_loads_once_from_the_registered_executor_then_calls_after_load(
    redis_url: str, tiny_model_dir: Path
) -> None:
    redis, keys = aioredis.Redis.from_url(redis_url, decode_responses=True), KeySchema("baton")
    loads: list[int] = []
    source = TokenizerSource(FleetRegistry(redis, keys), after_load=lambda: loads.append(1))
    with pytest.raises(NotReady):
        await source.get()
    await redis.zadd(keys.executors, {"exec-1": 1})
    record: dict[FieldT, EncodableT] = {
        "model": str(tiny_model_dir),
        "max_model_len": 512,
        "vocab_size": 0,
        "block_size": 16,
    }
    await redis.hset(keys.executor("exec-1"), mapping=record)
    tokenizer, limits = await source.get()
    assert (limits.model, limits.max_model_len) == (str(tiny_model_dir), 512)
    assert limits.vocab_size == len(tokenizer)  # type: ignore[arg-type]
    assert limits.block_size == 16  # submit names prompts' blocks with it
    assert await source.get() == (tokenizer, limits)
    assert loads == [1]  # once, after the load that happened
    await redis.aclose()
