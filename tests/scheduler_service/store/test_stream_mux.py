"""StreamMux: one XREAD serves many followers, each from its own position, without delaying newcomers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import cast

import redis.asyncio as aioredis

from common.redis_client import connect
from scheduler_service.store.stream_mux import StreamMux
from tests.stack import eventually


async def append(redis: aioredis.Redis, key: str, n: str) -> str:
    """XADD one entry; the client decodes replies, so its id comes back as a str."""
    return cast(str, await redis.xadd(key, {"n": n}))


def waiting_on(mux: StreamMux, key: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return key in mux._waiting

    return check


async def test_each_follower_gets_the_entries_after_its_position(redis_url: str) -> None:
    redis = connect(redis_url)
    mux = StreamMux(redis, block_ms=5000)
    first = await append(redis, "s:a", "1")
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

    async def blocked_on_idle_alone() -> bool:
        return mux._in_flight == {"s:idle"}

    await eventually(blocked_on_idle_alone, "the shared read to block on s:idle")
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


async def test_a_stream_published_here_reaches_its_reader_without_a_read(redis_url: str) -> None:
    redis = connect(redis_url)
    mux = StreamMux(redis, block_ms=5000)
    first = await append(redis, "s:local", "1")
    mux.published("s:local", first, {"n": "1"}, final=False)
    waiting = asyncio.create_task(mux.read("s:local", first, 8000))
    await eventually(waiting_on(mux, "s:local"), "the reader to wait")
    # Never written to Redis: only the local hand-over can deliver it.
    mux.published("s:local", "99999999999999-0", {"n": "2"}, final=False)
    assert [f["n"] for _, f in await asyncio.wait_for(waiting, 1.0)] == ["2"]
    await mux.close()
    await redis.aclose()


async def test_a_late_reader_of_a_local_stream_gets_what_it_missed(redis_url: str) -> None:
    redis = connect(redis_url)
    mux = StreamMux(redis, block_ms=5000)
    for n in ("1", "2"):
        mux.published("s:late", await append(redis, "s:late", n), {"n": n}, final=False)
    assert [f["n"] for _, f in await mux.read("s:late", "0", 2000)] == ["1", "2"]
    await mux.close()
    await redis.aclose()


async def test_a_late_reader_of_a_local_stream_is_served_from_memory(redis_url: str) -> None:
    redis = connect(redis_url)
    mux = StreamMux(redis, block_ms=5000)
    # Ids never written to Redis: only the kept entries can answer these reads.
    mux.published("s:mem", "100-0", {"n": "1"}, final=False)
    mux.published("s:mem", "100-1", {"n": "2"}, final=False)
    assert [f["n"] for _, f in await asyncio.wait_for(mux.read("s:mem", "100-0", 2000), 1.0)] == ["2"]
    mux.published("s:mem", "100-2", {"n": "3"}, final=True)
    # A finished stream's last entries stay for a late reader too.
    assert [f["n"] for _, f in await asyncio.wait_for(mux.read("s:mem", "100-0", 2000), 1.0)] == ["2", "3"]
    await mux.close()
    await redis.aclose()


async def test_a_reader_older_than_the_kept_entries_reads_redis(redis_url: str, monkeypatch) -> None:
    monkeypatch.setattr("scheduler_service.store.stream_mux.RECENT_ENTRIES", 2)
    redis = connect(redis_url)
    mux = StreamMux(redis, block_ms=5000)
    ids = []
    for n in ("1", "2", "3", "4"):
        ids.append(await append(redis, "s:old", n))
        mux.published("s:old", ids[-1], {"n": n}, final=False)
    assert [f["n"] for _, f in await mux.read("s:old", ids[0], 2000)] == ["2", "3", "4"]
    assert [f["n"] for _, f in await mux.read("s:old", ids[2], 2000)] == ["4"]
    await mux.close()
    await redis.aclose()


async def test_a_released_or_silent_local_stream_is_read_from_redis_again(redis_url: str, monkeypatch) -> None:
    redis = connect(redis_url)
    mux = StreamMux(redis, block_ms=300)
    released = await append(redis, "s:gone", "1")
    mux.published("s:gone", released, {"n": "1"}, final=False)
    mux.released("s:gone")  # handed back: another replica's link may write it now
    waiting = asyncio.create_task(mux.read("s:gone", released, 8000))
    await eventually(waiting_on(mux, "s:gone"), "the reader to wait")
    await redis.xadd("s:gone", {"n": "2"})
    assert [f["n"] for _, f in await asyncio.wait_for(waiting, 2.0)] == ["2"]

    monkeypatch.setattr("scheduler_service.store.stream_mux.LOCAL_GRACE_S", 0.2)
    silent = await append(redis, "s:silent", "1")
    mux.published("s:silent", silent, {"n": "1"}, final=False)  # its link then dies without a word
    await redis.xadd("s:silent", {"n": "2"})

    async def gone_silent() -> bool:
        return not mux._is_local("s:silent", time.monotonic())

    await eventually(gone_silent, "the grace to pass")
    got = await asyncio.wait_for(mux.read("s:silent", silent, 8000), 2.0)
    assert [f["n"] for _, f in got] == ["2"]
    await mux.close()
    await redis.aclose()


async def test_an_expected_stream_waits_for_its_link_not_for_a_shared_read(redis_url: str, monkeypatch) -> None:
    redis = connect(redis_url)
    mux = StreamMux(redis, block_ms=300)
    mux.expected("s:fresh")  # a link here took its request: nothing in the stream yet
    waiting = asyncio.create_task(mux.read("s:fresh", "0", 8000))
    await eventually(waiting_on(mux, "s:fresh"), "the reader to wait")
    assert mux._task is None, "no XREAD for a stream only this process writes"
    mux.published("s:fresh", "100-0", {"n": "1"}, final=False)  # never in Redis: the hand-over alone
    assert [f["n"] for _, f in await asyncio.wait_for(waiting, 1.0)] == ["1"]

    monkeypatch.setattr("scheduler_service.store.stream_mux.LOCAL_GRACE_S", 0.2)
    mux.expected("s:lost")  # its link then dies before the first token

    async def gone_silent() -> bool:
        return not mux._is_local("s:lost", time.monotonic())

    await eventually(gone_silent, "the grace to pass")
    await redis.xadd("s:lost", {"n": "1"})  # another replica's link ran it
    got = await asyncio.wait_for(mux.read("s:lost", "0", 8000), 2.0)
    assert [f["n"] for _, f in got] == ["1"]
    assert "s:lost" not in mux._local, "forgotten, not kept for good"
    await mux.close()
    await redis.aclose()


async def test_readers_of_an_expected_stream_that_stays_silent_go_back_to_the_shared_read(
    redis_url: str, monkeypatch
) -> None:
    monkeypatch.setattr("scheduler_service.store.stream_mux.LOCAL_GRACE_S", 0.2)
    redis = connect(redis_url)
    mux = StreamMux(redis, block_ms=5000)
    mux.expected("s:quiet")
    waiting = asyncio.create_task(mux.read("s:quiet", "0", 30_000))  # its own wait would be 30 s
    await eventually(waiting_on(mux, "s:quiet"), "the reader to wait")
    await asyncio.sleep(0.3)  # the grace is over: the shared read covers it again
    await redis.xadd("s:quiet", {"n": "1"})  # another replica's link runs it
    assert [f["n"] for _, f in await asyncio.wait_for(waiting, 2.0)] == ["1"]

    mux.expected("s:again")
    first = mux._local["s:again"]
    mux.released("s:again")  # handed back before its first token, then taken here again
    mux.expected("s:again")
    mux._forget_silent("s:again", first)  # the first mark's timer
    assert "s:again" in mux._local, "an old timer leaves the new mark alone"
    await mux.close()
    await redis.aclose()
