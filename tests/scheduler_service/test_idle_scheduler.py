"""An idle scheduler: what its planner reads and how often it wakes, on a stack of its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import RedisServer
from tests.scheduler_service.test_end_to_end import greedy
from tests.stack import Stack, joined_tokens, stack_config, start_stack


@pytest.fixture
async def lone_stack(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    """A stack on a redis-server of its own: Redis's command counts then hold this stack's calls
    only, not those of a stack another test left shutting down on the shared server."""
    server = RedisServer(tmp_path)
    try:
        running = await start_stack(stack_config(server.url, tiny_model_dir))
        yield running
        await running.stop()
    finally:
        server.stop()


async def test_an_idle_scheduler_does_not_read_the_queue_every_tick(lone_stack: Stack) -> None:
    stack = lone_stack
    await stack.wait_for_executors(1)
    await stack.generate(greedy([1, 5, 6], 2))  # the queue has been read, found empty again
    redis = stack.scheduler.frontend.store.redis
    await redis.config_resetstat()
    await asyncio.sleep(1.0)  # 20 planning ticks
    stats = await redis.info("commandstats")
    # The planner's queue read (one script: ZRANGE of the waiting tenants, ZCARD for the depth
    # gauge). An empty queue is re-read only on a wake or every 0.25 s, not every tick (the fleet
    # signals add a ZRANGE or two a second).
    assert stats.get("cmdstat_zcard", {}).get("calls", 0) <= 8  # a read per tick: 20
    assert stats.get("cmdstat_zrange", {}).get("calls", 0) <= 12
    # A wake still reads it at once: a new request is admitted and served.
    assert len(joined_tokens(await stack.generate(greedy([1, 7, 8], 3)))) == 3


async def test_an_idle_planner_sleeps_until_the_empty_queue_is_due_a_recheck(lone_stack: Stack) -> None:
    stack = lone_stack
    await stack.wait_for_executors(1)
    await stack.generate(greedy([1, 5, 6], 2))
    registry = stack.scheduler.dispatcher.metrics.registry

    def passes() -> float:
        return registry.get_sample_value("baton:plan_latency_seconds_count") or 0.0

    before = passes()
    await asyncio.sleep(1.0)
    # 20 ticks a second while work waits on time; with the queue known empty, a pass per recheck
    # (every 0.25 s) and the odd wake (a step report, the fleet signals).
    assert passes() - before <= 10
    # A submit wakes it at once: served as before.
    assert len(joined_tokens(await stack.generate(greedy([1, 7, 8], 3)))) == 3
