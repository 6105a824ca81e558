"""The executor's registration against a real redis-server: its heartbeat stops whenever stopped,
and a stop retires it for the schedulers' reaper."""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
from pathlib import Path

from common.keys import KeySchema
from common.redis_client import connect
from executor_service.registration import Registration
from tests.conftest import RedisServer, free_port
from tests.stack import eventually


async def test_stop_ends_the_heartbeat_wherever_it_lands(redis_url: str) -> None:
    """A stop landing inside a heartbeat's Redis call, where redis-py can absorb the cancel (about
    one in three did), used to leave the loop beating forever and the executor's shutdown hung."""
    redis = connect(redis_url)
    keys = KeySchema("regtest")
    rng = random.Random(0)
    try:
        for _ in range(60):
            registration = Registration(redis, keys, "e1", {"address": "x"}, lambda: {"kv": 1}, 1, 1000)
            await registration.start()
            await asyncio.sleep(rng.random() * 0.01)
            await asyncio.wait_for(registration.stop(), 2.0)
            assert await redis.zscore(keys.executors, "e1") == 0  # retired: silent, for the reaper
    finally:
        await redis.aclose()


async def test_a_stop_leaves_a_newer_process_under_the_same_id_alone(redis_url: str) -> None:
    """A restart that overlaps the old process's stop: the old one must not retire the new one."""
    redis = connect(redis_url)
    keys = KeySchema("regtest2")
    try:
        old = Registration(redis, keys, "e1", {"address": "a", "started_ms": 1}, lambda: {}, 1000, 1000)
        new = Registration(redis, keys, "e1", {"address": "b", "started_ms": 2}, lambda: {}, 1000, 1000)
        await old.start()
        await new.start()
        await old.stop()
        assert (await redis.zscore(keys.executors, "e1") or 0) > 0
        assert await redis.hget(keys.executor("e1"), "address") == "b"
        await new.stop()
        assert await redis.zscore(keys.executors, "e1") == 0
        assert not await redis.exists(keys.executor("e1"))
    finally:
        await redis.aclose()


async def test_a_beat_that_fails_with_a_defect_does_not_end_the_heartbeats(redis_url: str) -> None:
    """Only Redis errors were caught: any other error in one beat ended the loop for good, and a
    live executor was then reaped as dead."""
    redis = connect(redis_url)
    keys = KeySchema("regtest3")
    beats = 0

    def load() -> dict[str, int]:
        nonlocal beats
        beats += 1
        if beats == 2:
            raise RuntimeError("injected: a load reading that fails once")
        return {"beats": beats}

    registration = Registration(redis, keys, "e1", {"address": "a"}, load, 20, 1000)
    try:
        await registration.start()
        deadline = asyncio.get_running_loop().time() + 10
        while beats < 5:
            assert asyncio.get_running_loop().time() < deadline, "the heartbeats stopped after the failed beat"
            await asyncio.sleep(0.02)
    finally:
        await registration.stop()
        await redis.aclose()


async def test_an_executor_started_while_redis_is_away_registers_once_it_answers(tmp_path: Path) -> None:
    """Started during a Redis restart, an executor exited (its first beat failed the start): it
    serves, and registers with the first heartbeat that lands, as the other services ride it out."""
    port = free_port()
    redis = connect(f"redis://127.0.0.1:{port}/0")
    keys = KeySchema("regtest4")
    registration = Registration(redis, keys, "e1", {"address": "a"}, lambda: {"kv": 1}, 50, 5000)
    server = None
    try:
        await registration.start()  # nothing listens on the port yet
        binary = shutil.which("redis-server") or "redis-server"
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        server = subprocess.Popen([*args, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
        RedisServer._wait_ready_on(port)

        async def registered() -> bool:
            return bool(await redis.zscore(keys.executors, "e1"))

        await eventually(registered, "the executor to register once Redis answers", timeout=30)
    finally:
        await registration.stop()
        await redis.aclose()
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
