"""A gateway in front of a real stack (redis-server, scheduler, executor, the tiny model), one per
test module that asks for it, and an ``openai`` client of it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.conftest import RedisServer
from tests.gateway.serving import serve_gateway
from tests.stack import Stack, stack_config, start_stack

ALIAS = "tiny"  # the gateway's other name for the served model, which is registered by its path


@dataclass
class Served:
    stack: Stack
    base_url: str
    redis_url: str
    model_dir: Path

    def client(self, **kwargs: object) -> openai.AsyncOpenAI:
        # No retries: a retried 409 or 503 would hide what the gateway answered.
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
async def served(redis_server: RedisServer, tiny_model_dir: Path) -> AsyncIterator[Served]:
    # One stack for the module: starting executors is the slow part, and no test here depends on a clean Redis.
    redis_server.flush()
    stack = await start_stack(stack_config(redis_server.url, tiny_model_dir))
    try:
        async with serve_gateway(stack.target, model_aliases=(ALIAS,)) as base_url:
            yield Served(stack, base_url, redis_server.url, tiny_model_dir)
    finally:
        await stack.stop()


@pytest.fixture
async def client(served: Served) -> AsyncIterator[openai.AsyncOpenAI]:
    async with served.client() as c:
        yield c
