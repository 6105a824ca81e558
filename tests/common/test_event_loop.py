"""The services' event loop: uvloop where installed, with gRPC's aio stack and redis-py's on it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_returns_the_coroutines_result_on_uvloop_where_installed() -> None:
    if not event_loop.uvloop_available():
        pytest.skip("uvloop is not installed on this platform")
    assert event_loop.run(_loop_module()).startswith("uvloop")


async def _serve_and_watch(redis_url: str) -> tuple[list[int], object]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    statuses: list[int] = []
    try:
        await servicer.set("svc", health_pb2.HealthCheckResponse.NOT_SERVING)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="svc"))
            async for reply in watch:  # a server stream: the current status, then each change
                statuses.append(reply.status)
                if len(statuses) == 1:
                    await servicer.set("svc", health_pb2.HealthCheckResponse.SERVING)
                else:
                    watch.cancel()
                    break
    finally:
        await server.stop(None)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.set("event-loop-check", b"ok")
        got = await client.get("event-loop-check")
    finally:
        await client.aclose()
    return statuses, got


def test_grpc_streams_and_redis_calls_work_on_the_services_loop(redis_url: str) -> None:
    statuses, got = event_loop.run(_serve_and_watch(redis_url))
    assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]
    assert got == b"ok"
