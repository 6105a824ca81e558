"""Two executors behind one scheduler: work spreads by load, and inspect shows both."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from baton.client_commands import collect_inspection
from common.pb import generate_pb2 as pb
from tests.scheduler_service.test_end_to_end import greedy, random_prompts
from tests.stack import eventually, joined_tokens, stack_config, start_stack


async def test_work_spreads_over_two_executors(redis_url: str, tiny_model_dir: Path) -> None:
    stack = await start_stack(stack_config(redis_url, tiny_model_dir), executors=2)
    try:
        snapshot = collect_inspection(redis_url, "baton")
        assert sorted(e["id"] for e in snapshot["executors"]) == ["exec-0", "exec-1"]
        assert all(e["lease"] == stack.scheduler.dispatcher.replica_id for e in snapshot["executors"])
        requests = [greedy(p, 24, request_id=f"spread-{i}") for i, p in enumerate(random_prompts(20, seed=4))]
        results = await asyncio.gather(*(stack.generate(r) for r in requests))
        assert all(len(joined_tokens(chunks)) == 24 for chunks in results)
        placed: Counter[str] = Counter()
        for request in requests:
            status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id=request.request_id))
            placed[status.executor_id] += 1
        assert set(placed) == {"exec-0", "exec-1"}
        assert min(placed.values()) >= 5  # spread by free capacity, not all on the first executor
        snapshot = collect_inspection(redis_url, "baton")
        assert snapshot["requests_by_state"] == {"FINISHED": 20}
        assert all(e["load"]["kv_blocks_total"] > 0 for e in snapshot["executors"])
    finally:
        await stack.stop()


async def test_a_lease_taken_by_another_replica_drops_only_that_link(redis_url: str, tiny_model_dir: Path) -> None:
    """Every lease is renewed in one round trip; the one that failed to renew drops its link alone."""
    stack = await start_stack(stack_config(redis_url, tiny_model_dir), executors=2)
    try:
        dispatcher = stack.scheduler.dispatcher
        await dispatcher.store.redis.set(dispatcher.store.keys.lease("exec-1"), "sched-other", px=60_000)
        await dispatcher.discover_once()

        async def dropped() -> bool:
            return sorted(dispatcher.links) == ["exec-0"]

        await eventually(dropped, "the link to exec-1 to be dropped")
        assert await dispatcher.store.redis.get(dispatcher.store.keys.lease("exec-0")) == dispatcher.replica_id
        assert await dispatcher.store.redis.get(dispatcher.store.keys.lease("exec-1")) == "sched-other"
        tokens = joined_tokens(await stack.generate(greedy(random_prompts(1, seed=9)[0], 8)))
        assert len(tokens) == 8  # served by the executor it still holds
    finally:
        await stack.stop()
