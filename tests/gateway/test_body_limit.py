"""The gateway refuses an oversized body with 413 before reading it whole, and sends nothing on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from tests.gateway.serving import serve_gateway
from tests.stack import stack_config, start_stack


async def _chunks(total: int) -> AsyncIterator[bytes]:
    yield b'{"model": "m", "prompt": "'
    for _ in range(total // 1024):
        yield b"x" * 1024
    yield b'", "max_tokens": 2}'


async def test_an_oversized_body_is_413_and_leaves_nothing(redis_url: str, tiny_model_dir: Path) -> None:
    stack = await start_stack(stack_config(redis_url, tiny_model_dir))
    try:
        async with serve_gateway(stack.target, max_body_bytes=4096) as base, httpx.AsyncClient(base_url=base) as http:
            declared = await http.post("/v1/completions", content=b"{" + b" " * 5000 + b"}")
            chunked = await http.post("/v1/completions", content=_chunks(8192))  # no Content-Length
            for reply in (declared, chunked):
                assert reply.status_code == 413, reply.text
                assert "larger than 4096 bytes" in reply.json()["error"]["message"]
            small = await http.post(
                "/v1/completions", json={"model": str(tiny_model_dir), "prompt": "hi", "max_tokens": 2}
            )
            assert small.status_code == 200, small.text
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            assert len([k async for k in client.scan_iter(match="{baton}:req:*") if k.count(":") == 2]) == 1
        finally:
            await client.aclose()
    finally:
        await stack.stop()
