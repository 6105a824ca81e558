"""Start a real Baton stack in process: executors and a scheduler on free ports, against a real Redis."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from common.config import BatonConfig
from common.config_loading import with_overrides
from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from executor_service.server import RunningExecutor, start_executor
from scheduler_service.server import RunningScheduler, start_scheduler


def stack_config(redis_url: str, model_dir: Path, **sections: dict[str, Any]) -> BatonConfig:
    base = with_overrides(
        BatonConfig(),
        distributed={
            "redis_url": redis_url,
            "heartbeat_interval_ms": 200,
            "lease_ttl_ms": 1500,
            "executor_timeout_ms": 1500,
            "discovery_interval_ms": 100,
        },
        executor={
            "model": str(model_dir),
            "host": "127.0.0.1",
            "port": 0,
            "kv_cache_memory_mb": 32,
            "token_budget": 256,
        },
        scheduler={"host": "127.0.0.1", "port": 0},
    )
    return with_overrides(base, **sections) if sections else base


@dataclass
class Stack:
    config: BatonConfig
    scheduler: RunningScheduler
    executors: list[RunningExecutor]
    channel: grpc.aio.Channel

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.scheduler.port}"

    @property
    def stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(self.channel)

    async def wait_for_executors(self, count: int, timeout: float = 90.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            links = self.scheduler.dispatcher.links.values()
            if sum(1 for link in links if link.ready) >= count:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{count} executors did not attach")

    async def generate(self, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return [chunk async for chunk in self.stub.Generate(request)]

    async def stop(self) -> None:
        await _bounded(self.channel.close(), "channel close")
        await _bounded(self.scheduler.stop(grace=0.5), "scheduler stop")
        for executor in self.executors:
            await _bounded(executor.stop(grace=0.5), "executor stop")


async def _bounded(step: Awaitable[None], what: str, timeout: float = 15.0) -> None:
    """Fail loudly, naming the stuck tasks, instead of hanging a test's teardown."""
    try:
        await asyncio.wait_for(step, timeout)
    except TimeoutError:
        stuck = "\n".join(f"{t.get_name()}: {t.get_stack(limit=4)}" for t in asyncio.all_tasks())
        raise RuntimeError(f"{what} did not finish in {timeout} s; tasks:\n{stuck}") from None


async def start_stack(config: BatonConfig, executors: int = 1) -> Stack:
    running = []
    for i in range(executors):
        cfg = dataclasses.replace(config, executor=dataclasses.replace(config.executor, executor_id=f"exec-{i}"))
        running.append(await start_executor(cfg))
    scheduler = await start_scheduler(config)
    stack = Stack(config, scheduler, running, grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}"))
    await stack.wait_for_executors(executors)
    return stack


async def eventually(check: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = 15.0) -> None:
    """Wait until ``check`` (plain or async) holds, polling, or fail naming ``what`` after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        held = check()
        if held if isinstance(held, bool) else await held:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def joined_tokens(chunks: list[pb.GenerateResponse]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]
