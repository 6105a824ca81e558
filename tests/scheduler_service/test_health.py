"""gRPC health reflects readiness: executors after their model is loaded and warmed, schedulers
while Redis answers, and both report NOT_SERVING as they shut down."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import executor_service.server as executor_server
from common.config_loading import with_overrides
from executor_service.server import start_executor
from scheduler_service.server import start_scheduler
from tests.conftest import RedisServer, free_port
from tests.stack import stack_config

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def status(target: str) -> int | None:
    """The health status, or None when nothing answers."""
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.aio.AioRpcError:
            return None
    return int(reply.status)


async def watch(target: str, until: int, timeout: float = 60) -> list[int | None]:
    seen: list[int | None] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = await status(target)
        if not seen or seen[-1] != current:
            seen.append(current)
        if current == until:
            return seen
        await asyncio.sleep(0.02)
    raise AssertionError(f"never reached {until}: {seen}")


async def test_executor_is_not_serving_until_its_model_is_loaded(
    redis_url: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_load = executor_server.load_engine

    def slow_load(config: object, *args: object) -> object:
        time.sleep(1.0)  # a bigger model: the port is up long before the model
        return real_load(config, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(executor_server, "load_engine", slow_load)
    port = free_port()
    config = stack_config(redis_url, tiny_model_dir, executor={"port": port})
    starting = asyncio.create_task(start_executor(config))
    seen = await watch(f"127.0.0.1:{port}", SERVING)
    running = await starting
    assert NOT_SERVING in seen and seen[-1] == SERVING
    stopping = asyncio.create_task(running.stop(grace=1.0))
    await asyncio.sleep(0)
    assert await status(f"127.0.0.1:{port}") in (NOT_SERVING, None)
    await stopping


async def test_scheduler_is_serving_only_while_redis_answers(tmp_path: Path, tiny_model_dir: Path) -> None:
    redis_port = free_port()
    config = stack_config(f"redis://127.0.0.1:{redis_port}/0", tiny_model_dir)
    config = with_overrides(config, distributed={"redis_retry_s": 1.0})
    running = await start_scheduler(config)
    target = f"127.0.0.1:{running.port}"
    redis_proc = None
    try:
        assert await status(target) == NOT_SERVING  # set before the port opened; Redis is not up
        redis_proc = subprocess.Popen(
            ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL,
        )
        RedisServer._wait_ready_on(redis_port)
        assert (await watch(target, SERVING, timeout=15))[-1] == SERVING
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
        redis_proc = None
        assert (await watch(target, NOT_SERVING, timeout=15))[-1] == NOT_SERVING
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
        await running.stop(grace=0.5)
