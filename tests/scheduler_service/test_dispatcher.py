"""The dispatcher's background loops outlive what they should not die of: a defect in one
planning or discovery round, a message on the control channel that does not parse; and an executor
taken again after its lease lapsed stays driven."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from common.keys import KeySchema
from common.pb import generate_pb2 as pb
from common.redis_client import connect
from scheduler_service.dispatcher import Dispatcher
from scheduler_service.store import Store
from tests.conftest import RedisServer
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.scheduler_service.test_end_to_end import greedy, random_prompts
from tests.stack import Stack, eventually, joined_tokens, stack_config, start_stack


async def test_a_planning_round_that_raises_does_not_stop_admission(stack: Stack) -> None:
    admission = stack.scheduler.dispatcher.admission
    real_run = admission.run
    failures = 0

    async def fails_once(*args: object) -> int:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise RuntimeError("injected planning defect")
        return await real_run(*args)  # type: ignore[arg-type]

    admission.run = fails_once  # type: ignore[method-assign, assignment]
    chunks = await asyncio.wait_for(stack.generate(greedy(random_prompts(1, seed=41)[0], 8)), 60)
    assert failures == 1
    assert len(joined_tokens(chunks)) == 8 and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_a_discovery_round_that_raises_does_not_stop_discovery(stack: Stack) -> None:
    dispatcher = stack.scheduler.dispatcher
    real_discover = dispatcher.discover_once
    rounds = 0

    async def fails_first(*args: object) -> None:
        nonlocal rounds
        rounds += 1
        if rounds == 1:
            raise RuntimeError("injected discovery defect")
        await real_discover()

    dispatcher.discover_once = fails_first  # type: ignore[method-assign]
    await eventually(lambda: rounds >= 3, "discovery rounds after the failed one")
    chunks = await asyncio.wait_for(stack.generate(greedy(random_prompts(1, seed=42)[0], 8)), 60)
    assert len(joined_tokens(chunks)) == 8


async def test_control_messages_that_do_not_parse_are_skipped(stack: Stack, redis_url: str) -> None:
    """Anyone with Redis access can publish on the control channel: garbage there must not end the
    replica's subscription, or cancels from other replicas would stop reaching its executors."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    channel = KeySchema("baton").control_channel
    received: list[pb.GenerateResponse] = []

    async def stream() -> None:
        async for chunk in stack.stub.Generate(greedy(random_prompts(1, seed=43)[0], 4000, request_id="ctl-1")):
            received.append(chunk)

    task = asyncio.create_task(stream())
    try:
        await eventually(lambda: len(received) >= 2, "the request to start", 60)
        # Not JSON, not an object, cut short, nested past the parser's depth, not even UTF-8.
        for garbage in ("not json", "5", "[1, 2]", '{"abort": ', "[" * 100_000, b"\xff\xfe"):
            await client.publish(channel, garbage)
        executor_id = stack.executors[0].executor_id
        abort = f'{{"abort": "ctl-1", "executor": "{executor_id}"}}'
        # Bytes that are not UTF-8 fail inside redis-py, before any parsing: the replica subscribes
        # again, and what was published meanwhile is lost, as pub/sub loses it on any reconnect.
        for _ in range(150):
            await client.publish(channel, abort)
            if task.done():
                break
            await asyncio.sleep(0.2)
        await asyncio.wait_for(task, 10)  # an abort published after the garbage still ended it
    finally:
        task.cancel()
        await client.aclose()
    assert sum(len(c.token_ids) for c in received) < 4000
    assert received[-1].finish_reason == pb.FINISH_REASON_CANCELLED


async def test_a_link_taken_again_after_its_lease_lapsed_is_not_undone_by_the_old_ones_cleanup(
    stack: Stack, redis_url: str
) -> None:
    """A lease that lapses and is taken by another replica (a Redis stall or failover) ends the
    executor's link; the other lets it go, and this replica takes the executor again. The old
    link's cleanup drops the executor's index and releases its lease, fenced by the replica's id
    only: a new link started before that cleanup ends would lose both to it, and be dropped in
    turn, over and over."""
    dispatcher = stack.scheduler.dispatcher
    executor_id = stack.executors[0].executor_id
    keys = KeySchema("baton")
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        await stack.generate(greedy(random_prompts(1, seed=44)[0], 4))  # its prompt's blocks stay cached

        async def indexed() -> bool:
            return await client.scard(keys.cached_blocks(executor_id)) > 0

        await eventually(indexed, "the executor's index")
        old_link, old_task = dispatcher.links[executor_id], dispatcher._link_tasks[executor_id]
        real_close = old_link.close

        async def slow_close() -> None:
            await asyncio.sleep(1.0)  # a cleanup that spans several discovery rounds (100 ms here)
            await real_close()

        old_link.close = slow_close  # type: ignore[method-assign]
        await client.set(keys.lease(executor_id), "another-replica")  # it lapsed, and another took it
        await eventually(lambda: old_task.cancelling() > 0 or old_task.done(), "the link to be dropped")
        await client.delete(keys.lease(executor_id))  # the other lets it go while the old cleanup runs
        await asyncio.wait_for(old_task, 20)
        await eventually(lambda: executor_id in dispatcher.links, "the executor to be driven again")
        new_link = dispatcher.links[executor_id]
        assert new_link is not old_link
        chunks = await asyncio.wait_for(stack.generate(greedy(random_prompts(1, seed=45)[0], 8)), 60)
        assert len(joined_tokens(chunks)) == 8
        assert dispatcher.links.get(executor_id) is new_link, "the new link was dropped"
        assert await client.get(keys.lease(executor_id)) == dispatcher.replica_id
        assert await client.scard(keys.cached_blocks(executor_id)) > 0
    finally:
        await client.aclose()


async def test_redis_away_longer_than_the_leases_migrates_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Redis stalls past the lease TTL and the executor timeout (a failover, a paused primary):
    every lease and heartbeat lapses with nobody at fault. The replica keeps driving its executor,
    and no running request is re-queued or charged a migration."""
    server = RedisServer(tmp_path)
    stack = await start_stack(stack_config(server.url, tiny_model_dir))  # leases of 1.5 s
    try:
        store = stack.scheduler.dispatcher.store
        old_link = stack.scheduler.dispatcher.links[stack.executors[0].executor_id]
        prompts = random_prompts(3, seed=46)
        streams = [
            asyncio.create_task(stack.generate(greedy(p, 160, request_id=f"r{i}"))) for i, p in enumerate(prompts)
        ]

        async def running() -> bool:
            return all([await store.requests.token_count(f"r{i}") >= 4 for i in range(3)])

        await eventually(running, "the requests to run")
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(2.5)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        model = load_reference_model(tiny_model_dir)
        for i, (prompt, chunks) in enumerate(zip(prompts, results, strict=True)):
            assert_matches_reference(joined_tokens(chunks), reference_greedy(model, prompt, 160), f"r{i}")
            record = await store.requests.get(f"r{i}")
            assert record is not None and not record.get("migrations"), record
        assert stack.scheduler.dispatcher.links.get(stack.executors[0].executor_id) is old_link
    finally:
        await stack.stop()
        server.stop()


async def test_a_discovery_round_slow_of_its_own_is_no_redis_outage(
    redis_url: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grace after an outage (no heartbeat judged) is for Redis's silence: a round that spent
    its time reaping or handing back, with Redis answering all along, must not start it, or a
    replica whose rounds are slow would never judge a heartbeat again."""
    config = stack_config(redis_url, tiny_model_dir)
    store = Store(connect(redis_url), KeySchema(), config.distributed.request_ttl_s)
    dispatcher = Dispatcher(store, config)
    real_reap = dispatcher._reap_dead

    async def slow_reap(cutoff_ms: int) -> None:
        await asyncio.sleep(1.0)  # past the silence that counts as an outage (0.4 s here)
        await real_reap(cutoff_ms)

    monkeypatch.setattr(dispatcher, "_reap_dead", slow_reap)
    try:
        for _ in range(2):
            await dispatcher.discover_once()
        assert dispatcher._judge_heartbeats_from_ms == 0
    finally:
        await store.close()
