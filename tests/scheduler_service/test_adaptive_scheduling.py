"""Adaptive scheduling end to end: real redis-server, real executor and scheduler, the tiny model.

A one- or two-slot executor makes the queue order observable: each test reads who started
when from the request records in Redis (arrival and assignment times) or from the order in
which first tokens reach the clients. Nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any, cast

import grpc
import redis.asyncio as aioredis
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from common.keys import KeySchema
from common.pb import generate_pb2 as pb
from scheduler_service.estimator import estimator_key
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.scheduler_service.test_end_to_end import _first_chunks, greedy
from tests.stack import Stack, eventually, joined_tokens, stack_config, start_stack

KEYS = KeySchema()


def request(rid: str, max_tokens: int, priority: int = 5, tenant: str = "", **extra: Any) -> pb.GenerateRequest:
    msg = greedy([1, 9, 9, 9], max_tokens, priority=priority, request_id=rid)
    msg.tenant = tenant
    for name, value in extra.items():
        setattr(msg, name, value)
    return msg


async def start(redis_url: str, model: Path, max_batch: int = 1, **request_level: Any) -> Stack:
    scheduler = {"batch_level": {"max_batch_size": max_batch}, "request_level": request_level}
    return await start_stack(stack_config(redis_url, model, scheduler=scheduler))


async def first_token_order(stack: Stack, requests: list[pb.GenerateRequest], gap_s: float = 0.03) -> list[str]:
    """Submit ``requests`` ``gap_s`` apart behind the blocker, release it, and return their ids in
    the order their first tokens came."""
    order: list[str] = []

    async def run(msg: pb.GenerateRequest) -> None:
        async for chunk in stack.stub.Generate(msg):
            if chunk.index == 0 and chunk.token_ids:
                order.append(msg.request_id)

    tasks = []
    for msg in requests:
        tasks.append(asyncio.create_task(run(msg)))
        await asyncio.sleep(gap_s)
    await stack.stub.Cancel(pb.CancelRequest(request_id="blocker"))
    await asyncio.gather(*tasks)
    return order


async def block(stack: Stack, priority: int = 10) -> grpc.aio.UnaryStreamCall:
    """Occupy the executor's only slot until cancelled."""
    call = stack.stub.Generate(greedy([1, 5, 5], 3000, priority=priority, request_id="blocker"))
    await _first_chunks(call, 1)
    return call


async def test_strict_priority_then_fifo_within_a_priority(redis_url: str, tiny_model_dir: Path) -> None:
    stack = await start(redis_url, tiny_model_dir)
    try:
        blocker = await block(stack)
        requests = [request(rid, 2, p) for rid, p in [("p3a", 3), ("p7a", 7), ("p7b", 7), ("p3b", 3), ("p10", 10)]]
        requests.append(request("p0", 2, 0))
        order = await first_token_order(stack, requests)
        assert order == ["p10", "p7a", "p7b", "p3a", "p3b", "p0"]
        blocker.cancel()
    finally:
        await stack.stop()


async def test_bounded_wait_under_a_flood_of_priority_ten(redis_url: str, tiny_model_dir: Path) -> None:
    """A priority-0 request starts before every priority-10 request that arrives more than its
    aging bound (10 credits) after it, however long the flood lasts."""
    credit_ms = 60
    stack = await start(redis_url, tiny_model_dir, priority_credit_ms=credit_ms, preempt_priority_gap=0)
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        flood: list[asyncio.Future[pb.CompleteResponse]] = []
        for i in range(90):
            flood.append(asyncio.ensure_future(stack.stub.Complete(request(f"hi{i}", 6, 10))))
            if i == 10:
                low = asyncio.ensure_future(stack.stub.Complete(request("low", 2, 0)))
            await asyncio.sleep(0.01)
        await asyncio.gather(low, *flood)
        fields = ("arrival_ms", "assigned_ms")
        low_arrival, low_assigned = map(int, cast(list[str], await client.hmget(KEYS.request("low"), *fields)))
        later = []
        for i in range(90):
            arrival, assigned = map(int, cast(list[str], await client.hmget(KEYS.request(f"hi{i}"), *fields)))
            if arrival > low_arrival + 10 * credit_ms:
                later.append(assigned)
        assert later, "the flood must outlast the aging bound, or the test proves nothing"
        assert low_assigned <= min(later)
        # and the flood did overtake it: the queue was really contended
        assert low_assigned > low_arrival
    finally:
        await client.aclose()
        await stack.stop()


async def test_near_deadline_overtakes_earlier_requests_and_deadlines_are_counted(
    redis_url: str, tiny_model_dir: Path
) -> None:
    stack = await start(redis_url, tiny_model_dir, urgency_margin_ms=5000.0)
    try:
        blocker = await block(stack)
        requests = [request(f"calm{i}", 2, 5) for i in range(4)]
        deadline = int(time.time() * 1000) + 60_000  # roomy, so "met" holds however slow the machine
        # With a 5 s margin a deadline 3 s out makes it count as arrived 2 s ago.
        urgent_deadline = int(time.time() * 1000) + 3000
        requests.append(request("urgent", 2, 5, deadline_ms=urgent_deadline))
        requests.append(request("roomy", 2, 5, deadline_ms=deadline))
        order = await first_token_order(stack, requests)
        assert order[0] == "urgent"
        assert order[1:] == ["calm0", "calm1", "calm2", "calm3", "roomy"]
        metrics = stack.scheduler.dispatcher.metrics
        met = metrics.deadlines.labels("met")._value.get()
        missed = metrics.deadlines.labels("missed")._value.get()
        assert met + missed == 2 and met >= 1
        blocker.cancel()
    finally:
        await stack.stop()


async def test_equal_tenants_get_equal_tokens_whatever_their_request_rates(
    redis_url: str, tiny_model_dir: Path
) -> None:
    stack = await start(redis_url, tiny_model_dir, max_batch=2)
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        blocker = await block(stack)
        heavy = [request(f"a{i}", 4, 5, tenant="A") for i in range(100)]
        light = [request(f"b{i}", 4, 5, tenant="B") for i in range(10)]
        await first_token_order(stack, heavy + light, gap_s=0.002)
        times = {}
        for msg in heavy + light:
            arrival, assigned = cast(
                list[str], await client.hmget(KEYS.request(msg.request_id), "arrival_ms", "assigned_ms")
            )
            times[msg.request_id] = (int(arrival), int(assigned))
        # Saturation window: from B's first arrival (A already had a backlog) to B's last start.
        window_start = min(times[m.request_id][0] for m in light)
        window_end = max(times[m.request_id][1] for m in light)
        started = [rid for rid, (_, assigned) in times.items() if window_start <= assigned <= window_end]
        tokens_a = 4 * sum(rid.startswith("a") for rid in started)
        tokens_b = 4 * sum(rid.startswith("b") for rid in started)
        assert tokens_b == 40
        assert abs(tokens_a - tokens_b) <= 0.1 * tokens_b, (
            tokens_a,
            tokens_b,
            sorted(times.items(), key=lambda kv: kv[1][1]),
        )
        # The estimator learned each tenant's real output length from the finishes.
        estimator = await client.hgetall(KEYS.estimator)
        key = estimator_key("A", 4)
        assert int(estimator[f"{key}:n"]) >= 90 and float(estimator[f"{key}:mean"]) == 4.0
        blocker.cancel()
    finally:
        await client.aclose()
        await stack.stop()


async def test_priority_ten_preempts_priority_zero_which_resumes_exactly(redis_url: str, tiny_model_dir: Path) -> None:
    stack = await start(redis_url, tiny_model_dir, preempt_priority_gap=3, max_preemptions=2)
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    prompt = [1, 11, 12, 13, 14, 15]
    try:
        low_call = stack.stub.Generate(greedy(prompt, 80, priority=0, request_id="victim"))
        first = await _first_chunks(low_call, 3)
        high = await stack.stub.Complete(request("vip", 4, 10))
        assert high.finish_reason == pb.FINISH_REASON_LENGTH
        record = await client.hgetall(KEYS.request("victim"))
        assert record["state"] in ("QUEUED", "ASSIGNED", "RUNNING") and int(record["preemptions"]) == 1
        rest = [chunk async for chunk in low_call]
        got = joined_tokens(first + rest)
        assert_matches_reference(got, reference_greedy(load_reference_model(tiny_model_dir), prompt, 80), "victim")
        assert stack.scheduler.dispatcher.metrics.scheduler_preemptions._value.get() == 1
    finally:
        await client.aclose()
        await stack.stop()


async def test_under_load_the_room_a_preemption_makes_goes_to_the_request_it_was_made_for(
    redis_url: str, tiny_model_dir: Path
) -> None:
    """At full load admission offers a fraction of each executor's free KV; the victims were chosen
    against all of it. Offered the fraction, the important request fit nowhere and waited, the
    queue stalled behind it, for the other request to finish: the victim's work was thrown away
    for nothing."""
    scheduler = {
        "batch_level": {"max_batch_size": 8},
        "request_level": {"preempt_priority_gap": 3},
        "load_aware": {"low_load_threshold": 0.0, "high_load_threshold": 0.01, "min_admission_fraction": 0.5},
    }
    config = stack_config(redis_url, tiny_model_dir, executor={"kv_cache_memory_mb": 8}, scheduler=scheduler)
    stack = await start_stack(config)  # 128 blocks of 16 tokens; the two below take about 38 each
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    rng = random.Random(47)
    prompts = [[1] + [rng.randrange(5, 8000) for _ in range(length - 1)] for length in (600, 600, 1000)]
    try:
        keeper = asyncio.create_task(stack.generate(greedy(prompts[0], 300, priority=8, request_id="keeper")))
        victim = asyncio.create_task(stack.generate(greedy(prompts[1], 300, priority=0, request_id="victim")))

        async def both_running_at_full_load() -> bool:
            # The scheduler reads the executors' heartbeat load about once a second on its own,
            # which both requests may outlive on a fast machine: read it now.
            await stack.scheduler.dispatcher.refresh_signals()
            counts = [int(await client.llen(KEYS.tokens(rid))) for rid in ("keeper", "victim")]
            return min(counts) >= 2 and stack.scheduler.dispatcher.scorer.load_factor == 1.0

        await eventually(both_running_at_full_load, "both to run, at full load")
        # 63 blocks: more than the 52 or so free, fewer than the 90 free once the victim leaves,
        # more than the 45 that half of those is.
        vip = await stack.stub.Complete(greedy(prompts[2], 4, priority=10, request_id="vip"))
        assert vip.finish_reason == pb.FINISH_REASON_LENGTH
        assert int((await client.hgetall(KEYS.request("victim")))["preemptions"]) == 1
        vip_assigned = int(await client.hget(KEYS.request("vip"), "assigned_ms") or 0)
        keeper_finished = await client.hget(KEYS.request("keeper"), "finished_ms")
        assert not keeper_finished or vip_assigned < int(keeper_finished), "the vip waited for the keeper"
        await asyncio.gather(keeper, victim)
    finally:
        await client.aclose()
        await stack.stop()


async def test_a_short_request_backfills_past_one_waiting_for_room_without_delaying_it(
    redis_url: str, tiny_model_dir: Path
) -> None:
    """One tenant's second long request waits for the first's KV blocks, ahead of another tenant's
    short one in the queue. The short one is done long before the first frees anything, so it goes
    at once, beside them, instead of waiting behind both (a stall of minutes at production sizes)."""
    config = stack_config(redis_url, tiny_model_dir, executor={"kv_cache_memory_mb": 8})
    stack = await start_stack(config)  # 128 blocks of 16 tokens: two prompts of 69 do not fit together
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    rng = random.Random(53)
    long_prompts = [[1] + [rng.randrange(5, 8000) for _ in range(1099)] for _ in range(2)]
    try:
        first = asyncio.create_task(stack.generate(greedy(long_prompts[0], 400, priority=7, request_id="first")))

        async def first_running() -> bool:
            return int(await client.llen(KEYS.tokens("first"))) >= 2

        await eventually(first_running, "the first long request to run")
        second = asyncio.create_task(stack.generate(greedy(long_prompts[1], 400, priority=7, request_id="second")))

        async def second_waiting() -> bool:
            return await client.hget(KEYS.request("second"), "state") == "QUEUED"

        await eventually(second_waiting, "the second long request to queue")
        short = await stack.stub.Complete(greedy([1, 5, 6, 7], 8, priority=5, request_id="short"))
        assert short.finish_reason == pb.FINISH_REASON_LENGTH
        first_finished = await client.hget(KEYS.request("first"), "finished_ms")
        assert not first_finished, "the short request waited for the first long one to finish"
        await asyncio.gather(first, second)
        assert int(await client.hget(KEYS.request("second"), "preemptions") or 0) == 0
    finally:
        await client.aclose()
        await stack.stop()


async def test_a_request_cancelled_while_queued_ends_with_its_prompts_usage(
    redis_url: str, tiny_model_dir: Path
) -> None:
    """Its final event is published by the scheduler, not an executor: Resume, and every reader,
    see the usage the record gives (it was empty), as a final event from an executor has it."""
    stack = await start(redis_url, tiny_model_dir)
    try:
        blocker = await block(stack)
        waiting = stack.stub.Generate(request("queued", 4))
        store = stack.scheduler.frontend.store

        async def queued() -> bool:
            return bool(await store.redis.exists(KEYS.request("queued")))

        await eventually(queued, "the request to be queued")
        await stack.stub.Cancel(pb.CancelRequest(request_id="queued"))
        assert [chunk.finish_reason async for chunk in waiting][-1] == pb.FINISH_REASON_CANCELLED
        resumed = [chunk async for chunk in stack.stub.Resume(pb.ResumeRequest(request_id="queued"))]
        usage = resumed[-1].usage
        assert resumed[-1].finish_reason == pb.FINISH_REASON_CANCELLED
        assert (usage.prompt_tokens, usage.completion_tokens, usage.ttft_ms) == (4, 0, 0)
        blocker.cancel()
    finally:
        await stack.stop()


async def test_past_max_pending_low_priority_is_shed_first_with_a_retry_hint(
    redis_url: str, tiny_model_dir: Path
) -> None:
    stack = await start(redis_url, tiny_model_dir, max_pending_requests=10, shed_reserve_fraction=0.5)
    try:
        blocker = await block(stack)

        redis = stack.scheduler.frontend.store.redis

        async def submit(rid: str, priority: int) -> asyncio.Future[pb.CompleteResponse]:
            task = asyncio.ensure_future(stack.stub.Complete(request(rid, 2, priority)))

            async def arrived() -> bool:  # queued or refused: the next one sees the queue it left
                return task.done() or bool(await redis.exists(KEYS.request(rid)))

            await eventually(arrived, f"{rid} to be queued or refused")
            return task

        low = [await submit(f"low{i}", 0) for i in range(8)]  # priority 0 is refused at 5 queued
        high = [await submit(f"high{i}", 10) for i in range(6)]  # priority 10 only at 10
        await eventually(lambda: _all_done(low[5:] + high[5:]), "the refusals")
        for task in [*low[5:], *high[5:]]:
            exc = task.exception()
            assert isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(exc.trailing_metadata() or ())["retry-after-ms"] == "1000"
            status = rpc_status.from_call(exc)
            assert status is not None
            retry = error_details_pb2.RetryInfo()
            assert status.details[0].Unpack(retry) and retry.retry_delay.ToMilliseconds() == 1000
        await stack.stub.Cancel(pb.CancelRequest(request_id="blocker"))
        accepted = await asyncio.gather(*low[:5], *high[:5])  # nothing accepted is dropped
        assert all(r.finish_reason == pb.FINISH_REASON_LENGTH for r in accepted)
        assert stack.scheduler.dispatcher.metrics.shed.labels("0")._value.get() == 3
        blocker.cancel()
    finally:
        await stack.stop()


async def _all_done(tasks: list[asyncio.Future[Any]]) -> bool:
    return all(t.done() for t in tasks)
