"""Forgetting idle tenants against a real redis-server: only tenants idle past the bound, with
nothing queued or running, lose their counter, their length estimates and their stamp."""

from __future__ import annotations

from dataclasses import replace

from common.clock import now_ms
from common.lifecycle import FinishReason
from scheduler_service.estimator import estimator_fields, estimator_key
from scheduler_service.store import Store
from tests.scheduler_service.store_helpers import KEYS, finish, new_request

HOUR_S = 3600


async def arrive(store: Store, request_id: str, tenant: str) -> None:
    await store.requests.enqueue(replace(new_request(request_id), tenant=tenant), 100.0, 100)


async def test_a_queued_request_stamps_its_tenant(store: Store) -> None:
    before = now_ms()
    await arrive(store, "r", "acme")
    stamp = await store.redis.zscore(KEYS.tenants_seen, "acme")
    assert stamp is not None and before <= stamp <= now_ms()


async def test_no_stamp_is_kept_where_idle_tenants_are_never_forgotten(store: Store) -> None:
    await store.requests.enqueue_samples([replace(new_request("r"), tenant="acme")], 100.0, 100, stamp_tenant=False)
    assert await store.redis.zscore(KEYS.tenants_seen, "acme") is None
    assert (await store.requests.get("r") or {}).get("state") == "QUEUED"


async def test_only_tenants_idle_past_the_bound_with_nothing_in_the_system_are_forgotten(store: Store) -> None:
    for tenant in ("gone", "queued", "running", "recent"):
        await arrive(store, f"{tenant}-0", tenant)
        await store.redis.hset(KEYS.tenant_counters, tenant, 42)
        await store.redis.hset(KEYS.estimator, mapping={estimator_key(tenant, 100) + ":mean": 7, f"{tenant}|3:n": 5})
    for tenant in ("gone", "running", "recent"):
        await store.requests.claim(f"{tenant}-0", "exec-1")
    for tenant in ("gone", "recent"):
        assert await finish(store, f"{tenant}-0", "exec-1", FinishReason.STOP) == 1
    await store.redis.zadd(KEYS.tenants_seen, {"gone": 1, "queued": 1, "running": 1})  # long ago

    assert await store.tenants.forget(HOUR_S) == 1
    counters = await store.redis.hgetall(KEYS.tenant_counters)
    assert "gone" not in counters and {"queued", "running", "recent"} <= set(counters)
    estimates = [str(f) for f in await store.redis.hkeys(KEYS.estimator)]
    assert not [f for f in estimates if f.startswith("gone|")] and any(f.startswith("recent|") for f in estimates)
    seen = {t: await store.redis.zscore(KEYS.tenants_seen, t) for t in ("gone", "queued", "running")}
    assert seen["gone"] is None
    assert (seen["queued"] or 0) > 1 and (seen["running"] or 0) > 1  # still in the system: looked at again later
    assert await store.tenants.forget(HOUR_S) == 0


async def test_many_idle_tenants_are_forgotten_a_bounded_number_a_call(store: Store) -> None:
    tenants = [f"t{i}" for i in range(7)]
    await store.redis.hset(KEYS.tenant_counters, mapping=dict.fromkeys(tenants, 1))
    await store.redis.hset(KEYS.estimator, mapping={f: 1 for t in tenants for f in estimator_fields(t)[:3]})
    await store.redis.zadd(KEYS.tenants_seen, dict.fromkeys(tenants, 1))
    assert await store.tenants.forget(HOUR_S, per_call=2) == 7
    assert await store.redis.exists(KEYS.tenant_counters, KEYS.estimator, KEYS.tenants_seen) == 0
