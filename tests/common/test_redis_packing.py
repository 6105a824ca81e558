"""Commands packed by hiredis are the bytes redis-py would send, and a real server answers them."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.exceptions import DataError

from common.redis_client import connect
from common.redis_packing import HiredisConnection


def test_hiredis_packs_exactly_what_redis_py_packs() -> None:
    ours, theirs = HiredisConnection(), aioredis.Connection()
    for args in [
        ("EVALSHA", "abc", 3, "k1", b"k2", 1.5, 0.1, 1e20, -3, "héllo", "", 2**64, 2.0000000001),
        ("CLIENT ID",),
        (b"CLIENT UNBLOCK", 7),
        ("SET", "k", memoryview(b"raw")),
    ]:
        assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))


def test_what_hiredis_refuses_gets_redis_pys_error() -> None:
    with pytest.raises(DataError):
        HiredisConnection().pack_command("SET", "k", None)  # type: ignore[arg-type]


async def test_a_pooled_client_packs_with_hiredis_against_a_real_server(redis_url: str) -> None:
    redis = connect(redis_url)
    assert redis.connection_pool.connection_class is HiredisConnection
    assert await redis.set("packed", "é" * 3)
    assert await redis.get("packed") == "é" * 3
    async with redis.pipeline(transaction=False) as pipe:
        pipe.rpush("packed:list", *range(300))
        pipe.lrange("packed:list", 0, -1)
        _, items = await pipe.execute()
    assert items == [str(i) for i in range(300)]
    await redis.aclose()
