"""scheduler_service.store.prefix_index against a real redis-server: executors' cache events
applied in order, sets dropped, lease fencing, and leading runs of queued prompts' names."""

from __future__ import annotations

from typing import cast

from common.block_hashing import block_hashes
from scheduler_service.prompt_prefix import MAX_PREFIX_BLOCKS, name_text, prefix_fields
from scheduler_service.store import Store
from scheduler_service.store.prefix_index import CacheEvents
from tests.scheduler_service.store_helpers import KEYS, new_request

BLOCK = 4


async def held(store: Store, executor_id: str) -> set[str]:
    return set(cast(set[str], await store.redis.smembers(KEYS.cached_blocks(executor_id))))


def texts(*names: int) -> set[str]:
    return {name_text(n) for n in names}


async def test_events_are_applied_report_by_report_in_order(store: Store) -> None:
    await store.prefixes.apply("e1", [CacheEvents(cleared=True, stored=(1, 2, 3))])
    assert await held(store, "e1") == texts(1, 2, 3)
    # Several reports in one call: each after the one before it.
    await store.prefixes.apply(
        "e1",
        [
            CacheEvents(stored=(4,), removed=(1,)),
            CacheEvents(removed=(4,)),
            CacheEvents(stored=(4, 5)),
            CacheEvents(),  # a report with no events changes nothing
        ],
    )
    assert await held(store, "e1") == texts(2, 3, 4, 5)
    assert await store.prefixes.size("e1") == 4


async def test_cleared_replaces_the_whole_set(store: Store) -> None:
    await store.prefixes.apply("e1", [CacheEvents(cleared=True, stored=(1, 2, 3))])
    await store.prefixes.apply("e1", [CacheEvents(stored=(9,)), CacheEvents(cleared=True, stored=(7, 8))])
    assert await held(store, "e1") == texts(7, 8)
    await store.prefixes.apply("e1", [CacheEvents(cleared=True)])  # a restarted executor holding nothing
    assert await held(store, "e1") == set()


async def test_a_block_stored_and_removed_in_one_report_counts_as_gone(store: Store) -> None:
    await store.prefixes.apply("e1", [CacheEvents(cleared=True, stored=(1,))])
    await store.prefixes.apply("e1", [CacheEvents(stored=(2, 3), removed=(2,))])
    assert await held(store, "e1") == texts(1, 3)


async def test_a_first_report_with_many_blocks_is_applied_whole(store: Store) -> None:
    # More names than one SADD takes in the script (Lua's unpack limit): applied in slices.
    names = tuple(range(1, 12_001))
    await store.prefixes.apply("e1", [CacheEvents(cleared=True, stored=names)])
    assert await store.prefixes.size("e1") == len(names)
    await store.prefixes.apply("e1", [CacheEvents(removed=names[:11_000])])
    assert await store.prefixes.size("e1") == 1_000


async def test_names_are_uint64_hex(store: Store) -> None:
    top = 2**64 - 1
    await store.prefixes.apply("e1", [CacheEvents(cleared=True, stored=(top,))])
    assert await held(store, "e1") == {"ffffffffffffffff"}


async def test_drop_deletes_the_set(store: Store) -> None:
    await store.prefixes.apply("e1", [CacheEvents(cleared=True, stored=(1, 2))])
    await store.prefixes.apply("e2", [CacheEvents(cleared=True, stored=(1,))])
    assert await store.prefixes.drop("e1", "replica-a")
    assert not await store.redis.exists(KEYS.cached_blocks("e1"))
    assert await held(store, "e2") == texts(1)


async def test_another_replicas_lease_fences_writes_and_drops(store: Store) -> None:
    await store.prefixes.apply("e1", [CacheEvents(cleared=True, stored=(1, 2))], "replica-a")
    assert await store.fleet.take_lease("e1", "replica-b", 10_000)
    # replica-a lost the lease: its late events and its link's close leave replica-b's set alone.
    assert not await store.prefixes.apply("e1", [CacheEvents(removed=(1,))], "replica-a")
    assert not await store.prefixes.drop("e1", "replica-a")
    assert await held(store, "e1") == texts(1, 2)
    assert await store.prefixes.apply("e1", [CacheEvents(cleared=True, stored=(3,))], "replica-b")
    assert await held(store, "e1") == texts(3)
    assert await store.prefixes.drop("e1", "replica-b")
    assert await held(store, "e1") == set()


async def enqueue(store: Store, request_id: str, prompt: tuple[int, ...], block_size: int = BLOCK) -> list[str]:
    fields = prefix_fields(prompt, block_size)
    await store.requests.enqueue(new_request(request_id, prompt), 1.0, 1000, "", fields)
    return fields["prefix"].split(",") if fields else []


async def test_leading_runs_count_names_from_the_first_until_a_miss(store: Store) -> None:
    prompt = tuple(range(1, 4 * BLOCK + 3))  # four full blocks and a partial one
    names = await enqueue(store, "r1", prompt)
    assert names == [name_text(n) for n in block_hashes(prompt, BLOCK)] and len(names) == 4
    await store.redis.sadd(KEYS.cached_blocks("all"), *names)
    await store.redis.sadd(KEYS.cached_blocks("two"), names[0], names[1], names[3])  # block 2 evicted
    await store.redis.sadd(KEYS.cached_blocks("tail"), names[1], names[2], names[3])  # no first block
    (runs,) = await store.prefixes.leading_runs(["r1"], ["all", "two", "tail", "none"])
    assert runs.block_size == BLOCK
    assert runs.blocks == {"all": 4, "two": 2, "tail": 0, "none": 0}
    assert runs.marks == (names[0], names[1], names[3])  # blocks 1, 2 and 4


async def test_marks_are_the_names_at_powers_of_two_past_every_miss(store: Store) -> None:
    prompt = tuple(range(1, 9 * BLOCK + 1))  # nine full blocks
    names = await enqueue(store, "r1", prompt)
    (runs,) = await store.prefixes.leading_runs(["r1"], ["none"])  # the walk of the sets ends at once
    assert runs.blocks == {"none": 0}
    assert runs.marks == (names[0], names[1], names[3], names[7])


async def test_leading_runs_of_requests_without_names(store: Store) -> None:
    await enqueue(store, "short", (1, 2))  # fills no block
    await enqueue(store, "unknown", tuple(range(20)), block_size=0)  # block size unknown at submit
    await store.redis.sadd(KEYS.cached_blocks("e1"), "abc")
    await store.redis.set(KEYS.request("broken"), "not a hash")
    rows = await store.prefixes.leading_runs(["short", "unknown", "gone", "broken"], ["e1"])
    assert [(r.block_size, r.blocks, r.marks) for r in rows] == [(0, {"e1": 0}, ())] * 3 + [(0, {}, ())]
    assert await store.prefixes.leading_runs([], ["e1"]) == []
    assert [r.blocks for r in await store.prefixes.leading_runs(["short"], [])] == [{}]


async def test_names_past_the_cap_are_not_stored(store: Store) -> None:
    prompt = tuple(i % 50_000 for i in range((MAX_PREFIX_BLOCKS + 10) * BLOCK))
    names = await enqueue(store, "long", prompt)
    assert names == [name_text(n) for n in block_hashes(prompt, BLOCK)][:MAX_PREFIX_BLOCKS]
    stored = cast(str, await store.redis.hget(KEYS.request("long"), "prefix"))
    assert stored.split(",") == names and len(names) == MAX_PREFIX_BLOCKS
    await store.redis.sadd(KEYS.cached_blocks("e1"), *names)
    (runs,) = await store.prefixes.leading_runs(["long"], ["e1"])
    assert runs.blocks == {"e1": MAX_PREFIX_BLOCKS}
