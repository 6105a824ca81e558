"""StreamMux: one XREAD serves many followers, each from its own position, without delaying newcomers."""

from __future__ import annotations

import asyncio
import time

from common.redis_client import connect
from scheduler_service.stream_mux import StreamMux


async def test_each_follower_gets_the_entries_after_its_position(redis_url: str) -> None:
    redis = connect(redis_url)
    mux = StreamMux(redis, block_ms=5000)
    first = await redis.xadd("s:a", {"n": "1"})
    await redis.xadd("s:a", {"n": "2"})
    await redis.xadd("s:b", {"n": "3"})
    got_a, got_a_late, got_b = await asyncio.gather(
        mux.read("s:a", "0", 2000), mux.read("s:a", first, 2000), mux.read("s:b", "0", 2000)
    )
    assert [f["n"] for _, f in got_a] == ["1", "2"]
    assert [f["n"] for _, f in got_a_late] == ["2"]
    assert [f["n"] for _, f in got_b] == ["3"]
    await mux.close()
    await redis.aclose()


async def test_a_newcomer_cuts_a_blocked_read_short(redis_url: str) -> None:
    redis = connect(redis_url)
    mux = StreamMux(redis, block_ms=5000)  # without CLIENT UNBLOCK the newcomer would wait 5 s
    idle = asyncio.create_task(mux.read("s:idle", "0", 8000))
    await asyncio.sleep(0.2)  # the reader is now blocked on s:idle alone
    await redis.xadd("s:new", {"n": "1"})
    started = time.monotonic()
    got = await mux.read("s:new", "0", 8000)
    assert [f["n"] for _, f in got] == ["1"]
    assert time.monotonic() - started < 2.0
    await redis.xadd("s:idle", {"n": "2"})
    assert [f["n"] for _, f in await idle] == ["2"]
    await mux.close()
    await redis.aclose()


async def test_nothing_new_returns_empty_after_the_wait(redis_url: str) -> None:
    redis = connect(redis_url)
    mux = StreamMux(redis)
    started = time.monotonic()
    assert await mux.read("s:none", "0", 300) == []
    assert 0.25 < time.monotonic() - started < 2.0
    await mux.close()
    await redis.aclose()
