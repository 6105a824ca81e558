"""The pending queue's reads against a real redis-server: the admission round's one-call view gives
what the separate reads give, for every kind of head (a later sample, a malformed record, one gone)."""

from __future__ import annotations

from dataclasses import replace

from common.block_hashing import block_hashes
from scheduler_service.prompt_prefix import name_text, prefix_fields
from scheduler_service.samples import sample_requests
from scheduler_service.store import Store
from scheduler_service.store.queue import MalformedRecord
from tests.scheduler_service.store_helpers import KEYS, append, new_request

BLOCK = 16
PROMPT = tuple(range(1, 101))  # six full blocks and four tokens


async def queue(store: Store, request_id: str, tenant: str, score: float, prompt: tuple[int, ...] = PROMPT) -> None:
    req = replace(new_request(request_id, prompt), tenant=tenant)
    await store.requests.enqueue(req, score, 100, "", prefix_fields(prompt, BLOCK))


async def test_the_view_reads_tenants_heads_and_details_in_one_call(store: Store) -> None:
    for i in range(5):
        await queue(store, f"a{i}", "acme", 10.0 + i)
    await queue(store, "b0", "beta", 1.0)
    await store.requests.enqueue_samples(sample_requests(replace(new_request("m"), n=2, tenant="beta")), 2.0, 100)
    await store.requests.claim("m", "exec-1")  # sample 0 runs; its later sample waits in the queue
    assert await append(store, "m", "exec-1", 0, (5,)) == 1
    await store.redis.hset(KEYS.tenant_counters, mapping={"acme": 0, "beta": 3})
    await store.redis.zadd(KEYS.tenants_waiting, {"acme": 0, "beta": 3})

    view = await store.queue.admission_view(64, 4)
    assert view.queued == 7
    assert list(view.counters.items()) == [("acme", 0.0), ("beta", 3.0)]
    # ceil(4 / 2) + 2 = 4 heads a tenant, soonest first
    assert view.heads == {"acme": [(f"a{i}", 10.0 + i) for i in range(4)], "beta": [("b0", 1.0), ("m~1", 2.0)]}
    ids = [rid for rows in view.heads.values() for rid, _ in rows]
    assert [view.details[rid] for rid in ids] == await store.queue.queued_details(ids)
    later = view.details["m~1"]
    assert isinstance(later, dict)
    assert (later["first_state"], later["first_executor"], later["first_generated"]) == ("RUNNING", "exec-1", "1")
    assert view.running == {} and view.runs == {}  # neither asked for
    assert (await store.queue.admission_view(64, 4, with_running=True)).running == {"beta": 1}
    assert (await store.queue.admission_view(1, 1)).heads == {"acme": [("a0", 10.0)]}


async def test_a_head_redis_cannot_read_is_malformed_and_hides_nothing_else(store: Store) -> None:
    for rid, score in (("good", 1.0), ("bad", 2.0), ("gone", 3.0), ("later", 4.0)):
        await queue(store, rid, "acme", score)
    await store.redis.delete(KEYS.request("bad"))
    await store.redis.set(KEYS.request("bad"), "not a hash")
    await store.redis.delete(KEYS.request("gone"))
    view = await store.queue.admission_view(64, 8, prefix_executors=["exec-1"], prefix_heads=8)
    assert isinstance(view.details["bad"], MalformedRecord) and "WRONGTYPE" in view.details["bad"].reason
    assert view.details["gone"] is None
    assert isinstance(view.details["good"], dict) and isinstance(view.details["later"], dict)
    assert set(view.runs) == {"good", "later"}  # a head with no readable record has no prompt to look up


async def test_the_view_looks_up_cached_prefixes_as_leading_runs_does(store: Store) -> None:
    names = [name_text(n) for n in block_hashes(PROMPT, BLOCK)]
    await store.redis.sadd(KEYS.cached_blocks("all"), *names)
    await store.redis.sadd(KEYS.cached_blocks("two"), *names[:2])
    await store.redis.set(KEYS.cached_blocks("broken"), "not a set")  # holds nothing, breaks nothing
    for i in range(4):
        await queue(store, f"a{i}", "acme", float(i))
    await queue(store, "b0", "beta", 0.5, tuple(range(500, 600)))
    executors = ["all", "two", "broken", "none"]

    view = await store.queue.admission_view(64, 8, prefix_executors=executors, prefix_heads=2)
    assert set(view.runs) == {"a0", "a1", "b0"}  # each tenant's first two heads
    expected = await store.prefixes.leading_runs(["a0", "a1", "b0"], executors)
    assert [view.runs[rid] for rid in ("a0", "a1", "b0")] == expected
    assert view.runs["a0"].blocks == {"all": 6, "two": 2, "broken": 0, "none": 0}

    # Breadth first, as fair order takes the heads: each tenant's first before anyone's second.
    capped = await store.queue.admission_view(64, 8, prefix_executors=executors, prefix_heads=8, most_prefix_lookups=2)
    assert set(capped.runs) == {"a0", "b0"}
    # The names looked up are bounded too (a prompt is looked up whole once begun): a0's six
    # names on two sets, and a probe of each of the others, already spend ten.
    few = await store.queue.admission_view(64, 8, prefix_executors=executors, prefix_heads=8, most_prefix_names=10)
    assert set(few.runs) == {"a0"} and few.runs["a0"] == view.runs["a0"]
    assert (await store.queue.admission_view(64, 8, prefix_heads=8)).runs == {}  # no executor asked about


async def test_tenants_tied_past_the_read_are_drawn_not_passed_over_by_name(store: Store) -> None:
    tied = [f"t{i:02}" for i in range(20)]
    for tenant in ("zz", *tied):
        await queue(store, f"{tenant}-0", tenant, 1.0)
    await store.redis.zadd(KEYS.tenants_waiting, {"zz": -1.0, **dict.fromkeys(tied, 0.0)})
    times_read = dict.fromkeys(tied, 0)
    for draw in range(20):
        view = await store.queue.admission_view(4, 4, tie_draw=draw)
        assert next(iter(view.counters)) == "zz" and len(view.counters) == 4  # a smaller counter always
        assert set(view.heads) == set(view.counters) and set(view.counters.values()) == {-1.0, 0.0}
        for tenant in list(view.counters)[1:]:
            times_read[tenant] += 1
    # Each tied tenant as often as any other over the draws: a sorted set's name order alone would
    # read t00-t02 every round, and a window that did not wrap around would rarely read t00 or t19.
    assert set(times_read.values()) == {3}
    short = await store.queue.admission_view(64, 4, tie_draw=5)  # everything fits: no draw
    assert list(short.counters) == ["zz", *tied]


async def test_tenants_at_their_running_cap_hold_no_place_in_the_read(store: Store) -> None:
    capped = [f"c{i}" for i in range(4)]
    for tenant in (*capped, "free", "z"):
        await queue(store, f"{tenant}-0", tenant, 1.0)
    await store.redis.zadd(KEYS.tenants_waiting, {**dict.fromkeys(capped, 0.0), "free": 0.5, "z": 1.0})
    await store.redis.hset(KEYS.tenant_running, mapping={"c0": 1, "c1": 1, "c2": 1, "c3": 0, "free": 5})
    caps = {**dict.fromkeys(capped, 1), "free": 9}
    view = await store.queue.admission_view(3, 4, caps=caps, tie_draw=0)
    assert list(view.counters) == ["c3", "free", "z"]  # c0-c2 are at their cap; c3 is below it
    assert list((await store.queue.admission_view(3, 4, tie_draw=0)).counters) == ["c0", "c1", "c2"]  # no caps


async def test_thousands_of_configured_caps_are_read_in_slices(store: Store) -> None:
    # Lua's unpack takes a few thousand values at most: one HMGET of every capped name failed.
    caps = {f"t{i:05d}": 1 for i in range(12_000)}
    for tenant in ("t00000", "t11999", "free"):
        await queue(store, f"{tenant}-0", tenant, 1.0)
    await store.redis.zadd(KEYS.tenants_waiting, {"t00000": 0.0, "t11999": 0.0, "free": 0.5})
    await store.redis.hset(KEYS.tenant_running, mapping={"t00000": 1, "t11999": 1})
    view = await store.queue.admission_view(2, 4, caps=caps, tie_draw=0)
    assert list(view.counters) == ["free"]  # both at their cap, the last slice's as the first's
