"""scheduler_service.store.request_records and its Lua scripts, against a real redis-server: queueing, claims,
requeues, cancels and hand-backs. Recording steps: test_step_publisher.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from redis.typing import EncodableT

from common.errors import AlreadyExists, Overloaded
from common.lifecycle import FinishReason, RequestState
from common.redis_client import connect
from common.sampling_params import SamplingParams
from scheduler_service.samples import sample_requests
from scheduler_service.store import Store
from tests.scheduler_service.store_helpers import (
    ARRIVAL,
    KEYS,
    PROMPT,
    TTL_S,
    append,
    enqueue,
    finish,
    new_request,
    tokens_of,
)


async def test_enqueue_writes_the_record_and_queues_it(store: Store) -> None:
    await enqueue(store, "r1", score=42.5)
    record = await store.requests.get("r1")
    assert record is not None
    assert record["state"] == "QUEUED"
    assert record["prompt_ids"] == "11,12,13"
    assert record["prompt_len"] == "3"
    assert SamplingParams.from_json(record["params"]) == new_request("r1").params
    assert record["priority"] == "5"
    assert record["tenant"] == "acme"
    assert record["arrival_ms"] == str(ARRIVAL)
    assert record["executor"] == ""
    assert record["tokens_generated"] == "0"
    assert await store.queue.peek(10) == [("r1", 42.5)]
    assert await store.queue.length() == 1
    assert await store.queue.position("r1") == 0
    assert await store.queue.prompt_lengths(["r1", "missing"]) == [3, None]
    # Queued, not yet expiring.
    assert await store.redis.ttl(KEYS.request("r1")) == -1


async def test_enqueue_of_a_duplicate_id_raises_already_exists_and_changes_nothing(store: Store) -> None:
    await enqueue(store, "dup", score=1.0)
    with pytest.raises(AlreadyExists, match="dup"):
        await store.requests.enqueue(new_request("dup", prompt=(1,), priority=9), 0.0, 100)
    assert await store.queue.peek(10) == [("dup", 1.0)]
    record = await store.requests.get("dup")
    assert record is not None and record["prompt_ids"] == "11,12,13"


async def test_enqueue_into_a_full_queue_raises_overloaded_and_writes_nothing(store: Store) -> None:
    await enqueue(store, "a", max_pending=2)
    await enqueue(store, "b", max_pending=2)
    with pytest.raises(Overloaded, match="2 pending"):
        await enqueue(store, "c", max_pending=2)
    assert await store.requests.get("c") is None
    assert await store.queue.length() == 2


async def test_enqueues_made_together_share_round_trips_and_each_is_judged_alone(store: Store) -> None:
    """A batch stream's requests arrive together: their enqueue scripts go out pipelined, in order,
    and each still gets its own answer (here the third finds the queue full)."""
    results = await asyncio.gather(
        *(enqueue(store, rid, score=float(i), max_pending=2) for i, rid in enumerate(["a", "b", "c", "d"])),
        enqueue(store, "a"),
        return_exceptions=True,
    )
    assert results[:2] == [None, None]
    assert all(isinstance(r, Overloaded) for r in results[2:4])
    assert isinstance(results[4], AlreadyExists)
    assert await store.queue.peek(10) == [("a", 0.0), ("b", 1.0)]
    assert store.requests._enqueue.round_trips <= 2  # five calls: the first alone, the rest together


async def test_the_samples_of_a_request_are_queued_together_or_not_at_all(store: Store) -> None:
    samples = sample_requests(replace(new_request("multi"), n=3))
    await store.requests.enqueue_samples(samples, 7.0, 100)
    assert await store.queue.peek(10) == [("multi", 7.0), ("multi~1", 7.0), ("multi~2", 7.0)]
    first, second = await store.requests.get("multi"), await store.requests.get("multi~2")
    assert first is not None and second is not None
    assert first["n"] == "3" and "n" not in second  # sample 0's record keeps the count
    assert [SamplingParams.from_json(r["params"]).seed for r in (first, second)] == [3, 5]  # seed + k
    assert second["tenant"] == "acme" and second["prompt_ids"] == "11,12,13"
    # Sample 0's id taken: none of the samples is queued.
    with pytest.raises(AlreadyExists, match="'multi'"):
        await store.requests.enqueue_samples(sample_requests(replace(new_request("multi"), n=4)), 1.0, 100)
    assert await store.requests.get("multi~3") is None
    # Each sample counts against the shed limit: 3 queued + 3 more would pass 5.
    with pytest.raises(Overloaded):
        await store.requests.enqueue_samples(sample_requests(replace(new_request("more"), n=3)), 1.0, 5)
    assert await store.requests.get("more") is None and await store.queue.length() == 3


async def test_queued_details_of_a_later_sample_carry_its_first_samples_progress(store: Store) -> None:
    await store.requests.enqueue_samples(sample_requests(replace(new_request("m"), n=2)), 1.0, 100)
    first, later = await store.queue.queued_details(["m", "m~1"])
    assert isinstance(first, dict) and "first_state" not in first
    assert isinstance(later, dict)
    assert (later["first_state"], later["first_executor"], later["first_generated"]) == ("QUEUED", "", "0")
    await store.requests.claim("m", "exec-1")
    assert await append(store, "m", "exec-1", 0, (5,)) == 1
    (later,) = await store.queue.queued_details(["m~1"])
    assert isinstance(later, dict)
    assert (later["first_state"], later["first_executor"], later["first_generated"]) == ("RUNNING", "exec-1", "1")
    await store.redis.delete(KEYS.request("m"), KEYS.tokens("m"))
    (later,) = await store.queue.queued_details(["m~1"])
    assert isinstance(later, dict) and later["first_state"] == "" and later["first_generated"] == "0"


async def test_later_samples_scoring_their_prompt_run_on_their_own(store: Store) -> None:
    """A request asking for prompt logprobs computes its whole prompt on every sample (no prefix
    cache): its later samples neither wait for sample 0 nor follow it to its executor."""
    req = new_request("p")
    req = replace(req, n=2, params=replace(req.params, prompt_logprobs=1))
    await store.requests.enqueue_samples(sample_requests(req), 1.0, 100)
    first, later = await store.queue.queued_details(["p", "p~1"])
    assert isinstance(first, dict) and isinstance(later, dict)
    assert "first_state" not in later and later["alone"] == "1" and first["alone"] == ""


async def test_peek_pending_returns_lowest_scores_first(store: Store) -> None:
    for rid, score in [("late", 30.0), ("first", -5.0), ("middle", 10.0), ("second", 0.0)]:
        await enqueue(store, rid, score=score)
    assert await store.queue.peek(10) == [("first", -5.0), ("second", 0.0), ("middle", 10.0), ("late", 30.0)]
    assert await store.queue.peek(2) == [("first", -5.0), ("second", 0.0)]
    assert await store.queue.position("late") == 3


async def test_claim_many_judges_each_claim_in_one_round_trip(store: Store) -> None:
    await enqueue(store, "m1")
    await enqueue(store, "m2")
    claims = [("m1", "e1", "e1#a"), ("gone", "e1", "e1#a"), ("m2", "e2", "e2#b"), ("m1", "e2", "e2#b")]
    got = await store.requests.claim_many(claims)
    assert [c.request_id if c else None for c in got] == ["m1", None, "m2", None]  # m1 only once
    assert await store.requests.running_ids("e1") == {"m1"}
    assert await store.requests.running_ids("e2") == {"m2"}
    assert await store.queue.length() == 0


async def test_peek_pending_of_an_empty_queue_is_empty(store: Store) -> None:
    assert await store.queue.peek(5) == []


async def test_claim_moves_queued_to_assigned_on_the_executor(store: Store) -> None:
    await enqueue(store, "r1", score=7.0)
    claimed = await store.requests.claim("r1", "e1")
    assert claimed is not None
    assert claimed.request_id == "r1"
    assert claimed.prompt_ids == PROMPT
    assert claimed.output_ids == ()
    assert claimed.params == new_request("r1").params
    assert claimed.score == 7.0
    assert claimed.arrival_ms == ARRIVAL
    assert claimed.assigned_ms > 0
    assert claimed.first_token_ms is None
    record = await store.requests.get("r1")
    assert record is not None
    assert record["state"] == "ASSIGNED"
    assert record["executor"] == "e1"
    assert record["assigned_ms"] == str(claimed.assigned_ms)
    assert await store.requests.running_ids("e1") == {"r1"}
    assert await store.queue.peek(10) == []
    assert await store.queue.position("r1") is None


async def test_second_claim_returns_none(store: Store) -> None:
    await enqueue(store, "r1")
    assert await store.requests.claim("r1", "e1") is not None
    assert await store.requests.claim("r1", "e2") is None
    assert await store.requests.running_ids("e2") == set()
    record = await store.requests.get("r1")
    assert record is not None and record["executor"] == "e1"


async def test_claim_of_an_unknown_request_returns_none(store: Store) -> None:
    assert await store.requests.claim("nope", "e1") is None
    assert await store.requests.running_ids("e1") == set()


async def test_requeue_keeps_tokens_and_original_score_and_the_next_claim_resumes(store: Store) -> None:
    await enqueue(store, "r1", score=5.0)
    await enqueue(store, "r2", score=9.0)
    first = await store.requests.claim("r1", "e1")
    assert first is not None
    await append(store, "r1", "e1", 0, (7, 8))
    assert await store.requests.requeue("r1", "e1") == 1
    record = await store.requests.get("r1")
    assert record is not None
    assert record["state"] == "QUEUED"
    assert record["executor"] == ""
    assert record["preemptions"] == "1"
    assert await store.requests.running_ids("e1") == set()
    # Back ahead of r2, with the score it was first given.
    assert await store.queue.peek(10) == [("r1", 5.0), ("r2", 9.0)]
    assert await tokens_of(store.redis, "r1") == ["7", "8"]
    assert await store.queue.prompt_lengths(["r1"]) == [5]
    resumed = await store.requests.claim("r1", "e2")
    assert resumed is not None
    assert resumed.prompt_ids == PROMPT
    assert resumed.output_ids == (7, 8)
    assert resumed.score == 5.0
    assert resumed.assigned_ms == first.assigned_ms  # the first assignment time is kept for usage
    assert resumed.first_token_ms is not None
    assert await store.requests.running_ids("e2") == {"r1"}
    # The new executor continues from index 2.
    assert await append(store, "r1", "e2", 2, (9,)) == 3


async def test_requeue_by_a_wrong_executor_or_link_or_of_a_queued_request_does_nothing(store: Store) -> None:
    await enqueue(store, "r1")
    assert await store.requests.requeue("r1", "e1") == 0
    await store.requests.claim("r1", "e1")
    assert await store.requests.requeue("r1", "intruder") == 0
    assert await store.requests.requeue("r1", "e1", owner="e1#another-link") == -1
    record = await store.requests.get("r1")
    assert record is not None and record["state"] == "ASSIGNED"
    assert await store.requests.running_ids("e1") == {"r1"}


async def test_a_hand_back_by_anyone_from_an_executor_the_request_has_left_leaves_it_alone(store: Store) -> None:
    """The reaper and a new link hand back what an executor's running set names, with no owner: a
    request re-queued and claimed on another executor since is not pulled off it; the stale entry goes."""
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    await store.redis.sadd(KEYS.running("e0"), "r1")  # left behind in a set it was handed back from
    await store.requests.hand_back("r1", "e0", "migrate", owner="")
    record = await store.requests.get("r1")
    assert record is not None and (record["state"], record["executor"]) == ("ASSIGNED", "e1")
    assert record.get("migrations", "0") == "0"
    assert await store.requests.running_ids("e0") == set()
    assert await store.requests.running_ids("e1") == {"r1"}


async def test_cancel_of_a_queued_request_ends_it_here(store: Store) -> None:
    ended: list[FinishReason] = []
    store.requests.on_end = ended.append  # the metric of requests ended outside an executor
    await enqueue(store, "r1")
    outcome = await store.requests.cancel("r1")
    assert ended == [FinishReason.CANCELLED]
    assert outcome.state is RequestState.CANCELLED
    assert outcome.ended_here is True
    assert outcome.executor_id == ""
    assert outcome.tokens == 0
    record = await store.requests.get("r1")
    assert record is not None
    assert (record["state"], record["finish_reason"]) == ("CANCELLED", "CANCELLED")
    assert await store.queue.peek(10) == []
    assert 0 < await store.redis.ttl(KEYS.request("r1")) <= TTL_S
    # A cancelled request cannot be claimed.
    assert await store.requests.claim("r1", "e1") is None


async def test_cancel_of_a_requeued_request_corrects_its_tenants_charge_to_what_it_produced(store: Store) -> None:
    # Charged its expected 500 output tokens when first claimed, it made 2 before it was preempted.
    await enqueue(store, "r1")
    await store.redis.hset(KEYS.request("r1"), mapping={"est_out": 500, "fair_out_w": 1, "fair_cost": 0})
    await store.requests.claim("r1", "e1")
    await append(store, "r1", "e1", 0, (4, 5))
    await store.requests.hand_back("r1", "e1")
    before = float(await store.redis.hget(KEYS.tenant_counters, "acme") or 0)
    assert (await store.requests.cancel("r1")).ended_here
    assert float(await store.redis.hget(KEYS.tenant_counters, "acme") or 0) == before + (2 - 500)


async def test_cancel_of_a_running_request_flags_it_and_names_its_executor(store: Store) -> None:
    ended: list[FinishReason] = []
    store.requests.on_end = ended.append
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    await append(store, "r1", "e1", 0, (1, 2, 3))
    outcome = await store.requests.cancel("r1")
    assert ended == []  # its executor ends it, and its report counts it
    assert outcome.state is RequestState.RUNNING
    assert outcome.executor_id == "e1"
    assert outcome.tokens == 3
    assert outcome.ended_here is False
    record = await store.requests.get("r1")
    assert record is not None
    assert record["state"] == "RUNNING"
    assert record["cancel"] == "1"
    assert await store.requests.running_ids("e1") == {"r1"}


async def test_cancel_of_an_assigned_request_names_its_executor(store: Store) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    outcome = await store.requests.cancel("r1")
    assert (outcome.state, outcome.executor_id, outcome.ended_here) == (RequestState.ASSIGNED, "e1", False)


async def test_cancel_of_a_missing_or_finished_request(store: Store) -> None:
    missing = await store.requests.cancel("ghost")
    assert missing.state is None and missing.ended_here is False
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    await finish(store, "r1", "e1", FinishReason.STOP)
    done = await store.requests.cancel("r1")
    assert (done.state, done.ended_here) == (RequestState.FINISHED, False)


async def test_requeue_after_a_cancel_returns_two_and_hand_back_ends_it_cancelled(store: Store) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    await append(store, "r1", "e1", 0, (4, 5))
    await store.requests.cancel("r1")
    assert await store.requests.requeue("r1", "e1") == 2
    # Not re-queued: the cancel wins, and the same script ends it (a crash before the caller
    # publishes its final event cannot leave it in no queue and no running set, with no TTL).
    assert await store.queue.peek(10) == []
    assert await store.requests.running_ids("e1") == set()
    record = await store.requests.get("r1")
    assert record is not None and (record["state"], record["finish_reason"]) == ("CANCELLED", "CANCELLED")
    assert 0 < await store.redis.ttl(KEYS.request("r1")) <= TTL_S
    assert await store.redis.hget(KEYS.tenant_running, "acme") is None  # nothing running: out of the hash

    # hand_back is what callers use; run it on a fresh cancelled request.
    await enqueue(store, "r2")
    await store.requests.claim("r2", "e1")
    await append(store, "r2", "e1", 0, (4, 5))
    await store.requests.cancel("r2")
    await store.requests.hand_back("r2", "e1")
    record = await store.requests.get("r2")
    assert record is not None
    assert (record["state"], record["finish_reason"]) == ("CANCELLED", "CANCELLED")
    assert await store.queue.peek(10) == []
    assert await store.requests.running_ids("e1") == set()
    events = [e for _, e in await store.streams.read_events("r2", "0", 10)]
    assert [(e.index, e.token_ids, e.finish_reason) for e in events] == [(2, (), FinishReason.CANCELLED)]
    usage = events[0].usage or {}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 2)  # the record's, as an executor's end has
    for key in (KEYS.request("r2"), KEYS.tokens("r2"), KEYS.output("r2")):
        assert 0 < await store.redis.ttl(key) <= TTL_S, key


async def test_hand_back_without_a_cancel_requeues(store: Store) -> None:
    await enqueue(store, "r1", score=3.0)
    await store.requests.claim("r1", "e1")
    await store.requests.hand_back("r1", "e1")
    record = await store.requests.get("r1")
    assert record is not None and record["state"] == "QUEUED"
    assert await store.queue.peek(10) == [("r1", 3.0)]
    assert await store.streams.read_events("r1", "0", 10) == []


async def test_migrations_past_the_limit_fail_the_request(redis_url: str) -> None:
    client = connect(redis_url)
    store = Store(client, KEYS, request_ttl_s=TTL_S, max_migrations=1)
    ended: list[FinishReason] = []
    store.requests.on_end = ended.append
    try:
        await enqueue(store, "m1")
        await store.requests.claim("m1", "e1")
        await store.requests.hand_back("m1", "e1", "migrate")
        assert (await store.requests.get("m1") or {})["state"] == "QUEUED" and ended == []
        await store.requests.claim("m1", "e2")
        await store.requests.hand_back("m1", "e2", "migrate")
        record = await store.requests.get("m1")
        assert record is not None
        assert (record["state"], record["finish_reason"]) == ("FAILED", "ERROR")
        assert "lost more than 1 times" in record["error"] and ended == [FinishReason.ERROR]
        events = [e for _, e in await store.streams.read_events("m1", "0", 10)]
        assert [e.finish_reason for e in events] == [FinishReason.ERROR]
    finally:
        await client.aclose()


async def test_a_handed_back_request_rejoins_level_with_the_tenants_waiting(store: Store) -> None:
    # Its tenant's counter stood still while the request ran and another tenant was served: rejoining
    # at it would be credit banked while it had nothing waiting.
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    await store.redis.hset(KEYS.tenant_counters, "zed", 1000)
    await store.redis.zadd(KEYS.tenants_waiting, {"zed": 1000})
    await store.requests.hand_back("r1", "e1", "preempt")
    assert await store.redis.zscore(KEYS.tenants_waiting, "acme") == 1000
    assert float(await store.redis.hget(KEYS.tenant_counters, "acme") or 0) == 1000


async def test_claims_sent_to_a_redis_that_lost_its_scripts_run_again_not_quarantined(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarted between a claim pipeline's script check and its (retried) send: every claim
    came back NOSCRIPT. Healthy queued requests must not end FAILED as malformed."""
    await enqueue(store, "r1")
    await enqueue(store, "r2")
    real_load = aioredis.client.Pipeline.load_scripts

    async def load_then_lose(pipe: aioredis.client.Pipeline) -> None:
        await real_load(pipe)
        await store.redis.script_flush()  # what a restart leaves: no scripts

    monkeypatch.setattr(aioredis.client.Pipeline, "load_scripts", load_then_lose)
    claimed = await store.requests.claim_many([("r1", "e1", "e1"), ("r2", "e1", "e1")])
    assert [c.request_id if c else None for c in claimed] == ["r1", "r2"]
    assert await store.requests.running_ids("e1") == {"r1", "r2"}


async def test_an_enqueue_sent_twice_by_the_client_library_is_accepted_once(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py re-sends a command whose reply a dropped connection lost: the ENQUEUE ran, and its
    second run must not answer ALREADY_EXISTS for the submission that just succeeded."""
    real_enqueue = store.requests._enqueue

    async def reply_lost_then_retried(keys: list[str], args: list[EncodableT]) -> object:
        await real_enqueue(keys, args)  # ran in Redis; its reply never came back
        return await real_enqueue(keys, args)

    monkeypatch.setattr(store.requests, "_enqueue", reply_lost_then_retried)
    await enqueue(store, "r1")
    assert await store.queue.peek(10) == [("r1", 100.0)]
    monkeypatch.setattr(store.requests, "_enqueue", real_enqueue)
    with pytest.raises(AlreadyExists):  # another submission of the same id
        await enqueue(store, "r1")


async def test_a_claim_past_its_tenants_running_cap_is_refused_and_the_request_stays_queued(store: Store) -> None:
    """Two replicas each read the tenant's count below its cap, then both claim: the script, not
    the read, enforces the cap across the fleet."""
    await enqueue(store, "r1")
    await enqueue(store, "r2")
    assert await store.requests.claim_many([("r1", "e1", "e1")], caps={"acme": 1}) != [None]
    assert await store.requests.claim_many([("r2", "e2", "e2")], caps={"acme": 1}) == [None]
    assert (await store.requests.get("r2") or {})["state"] == "QUEUED"
    assert await store.queue.peek(10) == [("r2", 100.0)]
    assert await store.requests.claim_many([("r2", "e2", "e2")], caps={"acme": 2}) != [None]
