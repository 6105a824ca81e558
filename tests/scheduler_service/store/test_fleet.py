"""scheduler_service.store.fleet against a real redis-server: the registry's reads by heartbeat,
and leases taken, renewed and released only by their holder."""

from __future__ import annotations

from typing import cast

from redis.typing import EncodableT, FieldT

from scheduler_service.store import Store
from tests.scheduler_service.store_helpers import KEYS


async def register(store: Store, executor_id: str, heartbeat_ms: int, **record: str) -> None:
    await store.redis.zadd(KEYS.executors, {executor_id: heartbeat_ms})
    if record:
        await store.redis.hset(KEYS.executor(executor_id), mapping=cast(dict[FieldT, EncodableT], record))


async def test_the_registry_reads_by_heartbeat(store: Store) -> None:
    await register(store, "old", 1_000, address="10.0.0.1:1", load='{"running": 1}')
    await register(store, "new", 3_000, address="10.0.0.2:2")
    await register(store, "mid", 2_000)
    assert await store.fleet.registered() == ["old", "mid", "new"]
    assert await store.fleet.count() == 3
    assert await store.fleet.alive_since(2_000) == ["mid", "new"]  # at the cutoff counts as alive
    assert await store.fleet.silent_since(2_000) == ["old"]  # strictly before it
    assert await store.fleet.address_of("new") == "10.0.0.2:2"
    assert await store.fleet.address_of("mid") is None
    assert await store.fleet.loads(["old", "new", "gone"]) == ['{"running": 1}', None, None]
    assert await store.fleet.newest_record() == {"address": "10.0.0.2:2"}
    await store.fleet.forget("old")
    assert await store.fleet.registered() == ["mid", "new"]


async def test_the_newest_record_skips_an_executor_without_one(store: Store) -> None:
    assert await store.fleet.newest_record() == {}
    await register(store, "bare", 5_000)  # heartbeat came, its hash did not (or expired)
    assert await store.fleet.newest_record() == {}


async def test_a_lease_has_one_holder_until_released(store: Store) -> None:
    assert await store.fleet.take_lease("e1", "replica-a", 10_000)
    assert not await store.fleet.take_lease("e1", "replica-b", 10_000)
    assert await store.fleet.renew_leases(["e1"], "replica-a", 10_000) == [1]
    assert await store.fleet.renew_leases(["e1"], "replica-b", 10_000) == [0]
    assert await store.fleet.renew_leases([], "replica-a", 10_000) == []
    await store.fleet.release_lease("e1", "replica-b")  # not its holder: nothing changes
    assert cast(str, await store.redis.get(KEYS.lease("e1"))) == "replica-a"
    await store.fleet.release_lease("e1", "replica-a")
    assert await store.redis.get(KEYS.lease("e1")) is None
    assert await store.fleet.take_lease("e1", "replica-b", 10_000)


async def test_a_lapsed_lease_no_one_took_is_taken_again_by_its_renewal(store: Store) -> None:
    for executor_id in ("e1", "e2", "e3"):
        await register(store, executor_id, 5_000)
        assert await store.fleet.take_lease(executor_id, "replica-a", 10_000)
    await store.redis.delete(KEYS.lease("e1"), KEYS.lease("e2"), KEYS.lease("e3"))  # they lapsed: Redis was away
    assert await store.fleet.take_lease("e2", "replica-b", 10_000)  # another replica took one since
    await store.fleet.forget("e3")  # and another reaped one as dead
    assert await store.fleet.renew_leases(["e1", "e2", "e3"], "replica-a", 10_000) == [1, 0, 0]
    assert cast(str, await store.redis.get(KEYS.lease("e1"))) == "replica-a"
    assert int(await store.redis.pttl(KEYS.lease("e1"))) > 5_000
    assert cast(str, await store.redis.get(KEYS.lease("e2"))) == "replica-b"
    assert await store.redis.get(KEYS.lease("e3")) is None


async def test_renewal_restarts_the_lease_ttl(store: Store) -> None:
    assert await store.fleet.take_lease("e1", "replica-a", 1_000)
    assert await store.fleet.renew_leases(["e1"], "replica-a", 60_000) == [1]
    assert int(await store.redis.pttl(KEYS.lease("e1"))) > 30_000
