"""Group-committed script calls against a real redis-server: shared round trips, separate replies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from common.redis_client import connect
from scheduler_service.store.script_batcher import ScriptBatcher
from tests.conftest import RedisServer

# Appends ARGV[1] to the list KEYS[1] and returns the list's new length; fails on ARGV[1] == "bad".
PUSH = """
if ARGV[1] == 'bad' then return redis.error_reply('bad value') end
return redis.call('RPUSH', KEYS[1], ARGV[1])
"""


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    redis = connect(redis_url)
    yield redis
    await redis.aclose()


async def test_calls_made_together_share_round_trips_and_get_their_own_replies(client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(client, client.register_script(PUSH))
    replies = await asyncio.gather(*(batcher([f"list-{i % 3}"], [str(i)]) for i in range(30)))
    # Each list's lengths count up, in the order the calls were made.
    assert replies == [i // 3 + 1 for i in range(30)]
    assert await client.lrange("list-0", 0, -1) == [str(i) for i in range(0, 30, 3)]
    # All were made before the loop came round to sending: they share one round trip.
    assert batcher.round_trips == 1


async def test_an_idle_call_goes_out_at_once_on_its_own(client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(client, client.register_script(PUSH))
    assert await batcher(["solo"], ["a"]) == 1
    assert await batcher(["solo"], ["b"]) == 2
    assert batcher.round_trips == 2


async def test_a_failing_call_fails_alone(client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(client, client.register_script(PUSH))
    results = await asyncio.gather(
        batcher(["mixed"], ["first"]),
        batcher(["mixed"], ["a"]),
        batcher(["mixed"], ["bad"]),
        batcher(["mixed"], ["b"]),
        return_exceptions=True,
    )
    assert results[:2] == [1, 2] and results[3] == 3
    assert isinstance(results[2], ResponseError) and "bad value" in str(results[2])


async def test_a_flushed_script_cache_is_reloaded_for_every_call_that_met_it(client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(client, client.register_script(PUSH))
    await batcher(["warm"], ["0"])
    await client.script_flush()
    replies = await asyncio.gather(*(batcher(["warm"], [str(i)]) for i in range(1, 6)))
    assert sorted(replies) == [2, 3, 4, 5, 6]
    assert await client.llen("warm") == 6  # each call ran exactly once


async def test_a_lost_connection_fails_every_call_of_its_round_trip(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)  # its own: this test stops it
    redis = connect(server.url)
    batcher = ScriptBatcher(redis, redis.register_script(PUSH))
    try:
        await batcher(["x"], ["0"])
        server.stop()
        results = await asyncio.gather(*(batcher(["x"], [str(i)]) for i in range(4)), return_exceptions=True)
        assert all(isinstance(r, (RedisConnectionError, OSError)) for r in results), results
        assert batcher.round_trips == 2  # and nobody waits for ever
    finally:
        await redis.aclose()


async def test_a_call_cancelled_before_it_went_out_is_not_sent(client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(client, client.register_script(PUSH))
    kept = asyncio.ensure_future(batcher(["cancel"], ["kept"]))
    dropped = asyncio.ensure_future(batcher(["cancel"], ["dropped"]))
    await asyncio.sleep(0)  # both are queued; the sender has not run yet
    dropped.cancel()
    assert await kept == 1
    assert await client.lrange("cancel", 0, -1) == ["kept"]


async def test_a_sender_cancelled_before_it_ran_leaves_no_caller_waiting(client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(client, client.register_script(PUSH))
    waiting = asyncio.ensure_future(batcher(["stuck"], ["a"]))
    await asyncio.sleep(0)  # queued, and the sender task created but not yet run
    assert batcher._sender is not None
    batcher._sender.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 5)
    assert await batcher(["stuck"], ["b"]) == 1, "a later call starts a new sender"
