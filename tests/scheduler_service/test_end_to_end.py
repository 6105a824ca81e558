"""End to end through gRPC: real redis-server, real executor and scheduler servers, the tiny model."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from common.keys import KeySchema
from common.lifecycle import FinishReason, RequestState
from common.pb import generate_pb2 as pb
from common.sampling_params import SamplingParams
from scheduler_service.frontend import Frontend
from scheduler_service.requests import NewRequest, TokenEvent
from scheduler_service.store import Store
from scheduler_service.store.step_publisher import StepWrite
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.stack import Stack, eventually, joined_tokens, stack_config, start_stack


def greedy(prompt_ids: list[int], max_tokens: int, priority: int = 5, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority=priority,
    )


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, 8000) for _ in range(rng.randrange(4, 200))] for _ in range(count)]


async def test_staggered_greedy_matches_generate_alone(stack: Stack, tiny_model_dir: Path) -> None:
    prompts = random_prompts(16, seed=11)
    rng = random.Random(3)
    lengths = [rng.randrange(8, 48) for _ in prompts]

    async def one(i: int) -> list[int]:
        await asyncio.sleep(0.03 * i)  # join and leave a running batch at different moments
        return joined_tokens(await stack.generate(greedy(prompts[i], lengths[i])))

    outputs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    reference_model = load_reference_model(tiny_model_dir)
    for i, got in enumerate(outputs):
        assert_matches_reference(got, reference_greedy(reference_model, prompts[i], lengths[i]), f"prompt {i}")


async def test_fifty_concurrent_streams_finish(stack: Stack) -> None:
    prompts = random_prompts(50, seed=5)
    rng = random.Random(8)
    requests = [greedy(p, rng.randrange(1, 40), priority=rng.randrange(0, 11)) for p in prompts]
    results = await asyncio.gather(*(stack.generate(r) for r in requests))
    for request, chunks in zip(requests, results, strict=True):
        assert len(joined_tokens(chunks)) == request.params.max_tokens
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert all(c.finish_reason == pb.FINISH_REASON_NONE for c in chunks[:-1])
        assert [c.index for c in chunks] == sorted(c.index for c in chunks)
        assert chunks[-1].usage.completion_tokens == request.params.max_tokens
        assert chunks[-1].usage.prompt_tokens == len(request.prompt_token_ids)


async def test_complete_matches_joined_stream(stack: Stack) -> None:
    request = pb.GenerateRequest(prompt="The quick brown fox", params=pb.SamplingParams(max_tokens=24))
    chunks = await stack.generate(request)
    whole = await stack.stub.Complete(request)
    assert list(whole.token_ids) == joined_tokens(chunks)
    assert whole.text == "".join(c.text for c in chunks)
    assert whole.finish_reason == chunks[-1].finish_reason
    status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id=whole.request_id))
    assert status.state == pb.REQUEST_STATE_FINISHED
    assert status.tokens_generated == len(whole.token_ids)


async def test_stop_string_trims_text(stack: Stack) -> None:
    free = await stack.stub.Complete(greedy(random_prompts(1, seed=2)[0], 30))
    stop = free.text[len(free.text) // 2 :][:3]
    if not stop.strip():
        pytest.skip("the generated text has no usable stop string")
    request = greedy(random_prompts(1, seed=2)[0], 30)
    request.params.stop.append(stop)
    stopped = await stack.stub.Complete(request)
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.text == free.text[: free.text.index(stop)]


async def _first_chunks(call: grpc.aio.UnaryStreamCall, count: int) -> list[pb.GenerateResponse]:
    got = []
    async for chunk in call:
        got.append(chunk)
        if len(got) >= count:
            break
    return got


async def _wait_blocks_freed(stack: Stack, timeout: float = 10.0) -> None:
    allocator = stack.executors[0].loaded.engine.allocator
    deadline = asyncio.get_running_loop().time() + timeout
    while allocator.num_used and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    assert allocator.num_used == 0
    assert not stack.executors[0].loaded.engine.running


async def test_cancel_mid_stream_frees_kv_blocks(stack: Stack) -> None:
    call = stack.stub.Generate(greedy([1, 5, 6, 7], 3000, request_id="to-cancel"))
    await _first_chunks(call, 3)
    reply = await stack.stub.Cancel(pb.CancelRequest(request_id="to-cancel"))
    assert reply.state in (pb.REQUEST_STATE_RUNNING, pb.REQUEST_STATE_ASSIGNED)
    rest = [chunk async for chunk in call]
    assert rest[-1].finish_reason == pb.FINISH_REASON_CANCELLED
    await _wait_blocks_freed(stack)
    await _wait_state(stack, "to-cancel", pb.REQUEST_STATE_CANCELLED)


async def test_client_disconnect_aborts_request(stack: Stack) -> None:
    call = stack.stub.Generate(greedy([1, 9, 9, 9], 3000, request_id="walks-away"))
    await _first_chunks(call, 2)
    call.cancel()
    await _wait_blocks_freed(stack)
    await _wait_state(stack, "walks-away", pb.REQUEST_STATE_CANCELLED)


async def test_a_client_that_leaves_during_submit_leaves_nothing_running(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that leaves (or whose deadline passes) while its request is being submitted: the
    enqueue may already be in Redis, so the request must be abandoned once queued, on a Generate
    stream and on a GenerateBatch stream alike, instead of running to its end for nobody."""
    frontend = stack.scheduler.frontend
    submit, queued = frontend.submit, asyncio.Queue[str]()

    def slow_submit(msg: pb.GenerateRequest) -> Coroutine[Any, Any, NewRequest]:
        caller = asyncio.current_task()  # the RPC's handler (or batch follower), wherever the submit runs

        async def submitting() -> NewRequest:
            req = await submit(msg)
            queued.put_nowait(req.request_id)
            assert caller is not None
            await asyncio.wait({caller}, timeout=30)  # the submit ends only once its client has gone
            return req

        return submitting()

    monkeypatch.setattr(frontend, "submit", slow_submit)
    call = stack.stub.Generate(greedy([1, 9, 8, 7], 3000, request_id="left-in-submit"))
    reading = asyncio.ensure_future(call.initial_metadata())
    assert await asyncio.wait_for(queued.get(), 30) == "left-in-submit"
    call.cancel()
    reading.cancel()

    async def two_requests() -> AsyncIterator[pb.GenerateRequest]:
        for rid in ("batch-left-1", "batch-left-2"):
            yield greedy([1, 9, 8, 6], 3000, request_id=rid)
        await asyncio.Event().wait()  # the stream stays open until the client cancels it

    batch = stack.stub.GenerateBatch(two_requests())
    reading = asyncio.ensure_future(batch.initial_metadata())
    assert {await asyncio.wait_for(queued.get(), 30) for _ in range(2)} == {"batch-left-1", "batch-left-2"}
    batch.cancel()
    reading.cancel()
    for rid in ("left-in-submit", "batch-left-1", "batch-left-2"):
        await _wait_state(stack, rid, pb.REQUEST_STATE_CANCELLED)
    await _wait_blocks_freed(stack)


async def test_a_cancel_that_lands_while_the_request_is_claimed_still_ends_it(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CANCEL flags a claimed request and asks its link to abort it; a link that has not admitted it
    yet (the claim's round trip is in flight) does not know it, so the abort is lost. The flag is
    read again when the request's first tokens are recorded, and the link aborts it then."""
    records = stack.scheduler.store.requests
    claim_many = records.claim_many

    async def cancelled_during_claim(claims: Any, caps: Any = None) -> Any:
        results = await claim_many(claims, caps)
        for request_id, _, _ in claims:
            if request_id == "cancelled-in-claim":
                assert await stack.scheduler.frontend.cancel(request_id) == RequestState.ASSIGNED
        return results

    monkeypatch.setattr(records, "claim_many", cancelled_during_claim)
    chunks = [chunk async for chunk in stack.stub.Generate(greedy([1, 9, 8, 5], 3000, request_id="cancelled-in-claim"))]
    assert chunks[-1].finish_reason == pb.FINISH_REASON_CANCELLED
    assert sum(len(chunk.token_ids) for chunk in chunks) < 3000
    await _wait_state(stack, "cancelled-in-claim", pb.REQUEST_STATE_CANCELLED)
    await _wait_blocks_freed(stack)


async def _wait_state(stack: Stack, request_id: str, state: int) -> None:
    """The executor frees KV first; the scheduler records the end a moment later."""

    async def reached() -> bool:
        status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id=request_id))
        return bool(status.state == state)

    await eventually(reached, f"{request_id} to reach state {state}")


async def test_a_request_longer_than_the_kv_cache_holds_is_refused_at_submit(
    redis_url: str, tiny_model_dir: Path
) -> None:
    """1 MB of the tiny model's KV holds 256 tokens: its executor serves 256, and the scheduler
    refuses longer at submit, where it used to run and fail part way through its output."""
    stack = await start_stack(stack_config(redis_url, tiny_model_dir, executor={"kv_cache_memory_mb": 1}))
    try:
        info = await stack.stub.ModelInfo(pb.ModelInfoRequest())
        assert info.max_model_len == 256
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(greedy([1] + [5] * 199, 100))  # 200 + 100 tokens
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Nothing was queued, so nothing holds up the next request; one of the whole length runs.
        assert len(joined_tokens(await stack.generate(greedy([1, 5, 6, 7], 250)))) == 250
    finally:
        await stack.stop()


async def test_get_request_reports_queued_with_position(redis_url: str, tiny_model_dir: Path) -> None:
    config = stack_config(redis_url, tiny_model_dir, scheduler={"batch_level": {"max_batch_size": 1}})
    stack = await start_stack(config)
    try:
        blocker = stack.stub.Generate(greedy([1, 5, 5], 3000, request_id="blocker"))
        await _first_chunks(blocker, 1)
        waiting = stack.stub.Generate(greedy([1, 6, 6], 4, request_id="waiting"))

        async def accepted() -> bool:
            return await stack.scheduler.frontend.store.requests.get("waiting") is not None

        await eventually(accepted, "the waiting request to be queued")
        status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id="waiting"))
        assert status.state == pb.REQUEST_STATE_QUEUED
        assert status.queue_position == 0
        running = await stack.stub.GetRequest(pb.GetRequestRequest(request_id="blocker"))
        assert running.state == pb.REQUEST_STATE_RUNNING
        assert running.executor_id == "exec-0"
        await stack.stub.Cancel(pb.CancelRequest(request_id="blocker"))
        assert joined_tokens([c async for c in waiting]) != []
        blocker.cancel()
    finally:
        await stack.stop()


async def test_admission_follows_priority_order(redis_url: str, tiny_model_dir: Path) -> None:
    config = stack_config(redis_url, tiny_model_dir, scheduler={"batch_level": {"max_batch_size": 1}})
    stack = await start_stack(config)
    try:
        blocker = stack.stub.Generate(greedy([1, 5, 5], 3000, request_id="blocker"))
        await _first_chunks(blocker, 1)
        order: list[str] = []

        async def run(request_id: str, priority: int) -> None:
            async for chunk in stack.stub.Generate(greedy([1, 7, 7], 2, priority=priority, request_id=request_id)):
                if chunk.index == 0 and chunk.token_ids:
                    order.append(request_id)

        tasks = []
        for request_id, priority in [("low", 1), ("mid", 5), ("high", 9), ("mid2", 5)]:
            tasks.append(asyncio.create_task(run(request_id, priority)))
            await asyncio.sleep(0.05)
        await stack.stub.Cancel(pb.CancelRequest(request_id="blocker"))
        await asyncio.gather(*tasks)
        assert order == ["high", "mid", "mid2", "low"]
        blocker.cancel()
    finally:
        await stack.stop()


async def test_resume_replays_a_finished_request_from_an_index(stack: Stack) -> None:
    whole = await stack.stub.Complete(greedy([1, 6, 7, 8], 10, request_id="replay-me"))
    resumed = [c async for c in stack.stub.Resume(pb.ResumeRequest(request_id="replay-me", from_index=4))]
    assert joined_tokens(resumed) == list(whole.token_ids)[4:]
    assert resumed[0].index == 4
    assert resumed[-1].finish_reason == pb.FINISH_REASON_LENGTH
    past = [c async for c in stack.stub.Resume(pb.ResumeRequest(request_id="replay-me", from_index=100))]
    assert [(c.index, list(c.token_ids), c.finish_reason) for c in past] == [(10, [], pb.FINISH_REASON_LENGTH)]


async def test_resume_from_the_start_sends_each_first_message_whole(stack: Stack) -> None:
    """Replayed from index 0, a stream's first message carries what a Generate call's does: the
    prompt's size in its usage, and its ids where asked; from a later index, no ids."""
    asked = greedy([1, 6, 7, 9], 3, request_id="replay-first")
    asked.return_prompt_token_ids = True
    streamed = [c async for c in stack.stub.Generate(asked)]
    request = pb.ResumeRequest(request_id="replay-first", return_prompt_token_ids=True)
    resumed = [c async for c in stack.stub.Resume(request)]
    for messages in (streamed, resumed):
        assert list(messages[0].prompt_token_ids) == [1, 6, 7, 9] and messages[0].usage.prompt_tokens == 4
        assert not any(m.prompt_token_ids for m in messages[1:])
    plain = [c async for c in stack.stub.Resume(pb.ResumeRequest(request_id="replay-first"))]
    assert not plain[0].prompt_token_ids and plain[0].usage.prompt_tokens == 4
    later = [c async for c in stack.stub.Resume(pb.ResumeRequest(request_id="replay-first", from_index=1))]
    assert later[0].index == 1 and not any(m.prompt_token_ids for m in later)


async def test_resume_inside_a_chunk_of_tokens_sends_the_text_of_the_rest(stack: Stack, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    request = greedy([1, 6, 7, 8], 10, request_id="chunked")
    request.params.stream_interval_tokens = 4  # stream entries of 4 tokens: from index 2 is inside the first
    whole = await stack.stub.Complete(request)
    resumed = [c async for c in stack.stub.Resume(pb.ResumeRequest(request_id="chunked", from_index=2))]
    assert joined_tokens(resumed) == list(whole.token_ids)[2:]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert resumed[0].text == tokenizer.decode(list(resumed[0].token_ids), skip_special_tokens=True)


async def claimed_by_a_ghost(stack: Stack, request_id: str) -> tuple[Store, Frontend]:
    """A request claimed for executor "ghost", under a key prefix of its own (so the running
    scheduler cannot claim it first), and a frontend reading that prefix."""
    live = stack.scheduler.frontend
    store = Store(live.store.redis, KeySchema(request_id), request_ttl_s=60)
    frontend = Frontend(store, live.dispatcher, live.tokenizers, live.config, live.scorer, live.metrics)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    await store.requests.enqueue(NewRequest(request_id, (1, 5, 6), params, 5, "t", 0, 0), -1e18, 100)
    assert await store.requests.claim(request_id, "ghost") is not None
    return store, frontend


async def test_reader_repairs_tokens_recorded_but_never_published(stack: Stack) -> None:
    store, frontend = await claimed_by_a_ghost(stack, "gap-1")
    async with store.redis.pipeline(transaction=False) as pipe:  # a writer that died before publishing
        await store.requests.append_tokens(pipe, "gap-1", "ghost", TokenEvent(0, (11, 12, 13), ""))
        await pipe.execute()
    usage = {"prompt_tokens": 3.0, "completion_tokens": 4.0}
    await store.steps.publish("ghost", [StepWrite("gap-1", TokenEvent(3, (14,), "x", FinishReason.LENGTH, usage))])
    events = [e async for e in frontend.events("gap-1")]
    # The repaired tokens and the published one arrive together: one message, in order, no gap.
    assert [(e.index, e.token_ids) for e in events] == [(0, (11, 12, 13, 14))]
    assert events[-1].finish_reason is FinishReason.LENGTH


async def test_a_reader_ends_a_request_whose_record_ended_without_its_final_event(stack: Stack) -> None:
    """A writer that ended the record and died before publishing the final event: a reader then
    sends the tokens recorded and the end from the record, rather than wait until the record expires."""
    store, frontend = await claimed_by_a_ghost(stack, "lost-1")
    async with store.redis.pipeline(transaction=False) as pipe:
        await store.requests.append_tokens(pipe, "lost-1", "ghost", TokenEvent(0, (11, 12), ""))
        await store.requests.finish(pipe, "lost-1", "ghost", FinishReason.CANCELLED)
        await pipe.execute()
    await store.redis.hset(store.keys.request("lost-1"), "finished_ms", 1)  # long ago
    events = [e async for e in frontend.events("lost-1")]
    assert [(e.index, e.token_ids, e.finish_reason) for e in events] == [(0, (11, 12), FinishReason.CANCELLED)]
    published = await store.streams.read_events("lost-1", "0", 10)
    assert [e.finish_reason for _, e in published] == [FinishReason.CANCELLED]  # for every other reader too


async def test_a_token_write_lost_by_redis_is_recovered_exactly(stack: Stack, tiny_model_dir: Path) -> None:
    """A failover can lose a write the old primary acknowledged: Redis then holds fewer tokens than
    the executor has made, and refuses every later write as a gap. The link must re-queue the
    request, which resumes from Redis's record; the client sees each token once, all correct."""
    redis = stack.scheduler.frontend.store.redis
    prompt = [1, 21, 22, 23, 24]
    call = stack.stub.Generate(greedy(prompt, 90, request_id="loses-a-write"))
    first = await _first_chunks(call, 4)
    await redis.rpop(KeySchema().tokens("loses-a-write"), 2)  # the acknowledged writes that vanished
    rest = [chunk async for chunk in call]
    got = joined_tokens(first + rest)
    assert_matches_reference(got, reference_greedy(load_reference_model(tiny_model_dir), prompt, 90), "recovered")
    assert [c.index for c in first + rest] == sorted({c.index for c in first + rest})
    assert int(cast(str, await redis.hget(KeySchema().request("loses-a-write"), "migrations"))) >= 1


async def test_a_submission_whose_reply_redis_dropped_is_sent_again_and_runs_once(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submission rides out a Redis outage as every other call does: the queueing landed, its
    reply was lost with the connection, and the retry (the same submission) finds its own record."""
    records = stack.scheduler.store.requests
    real_enqueue = records._enqueue
    dropped: list[bool] = []

    async def reply_lost_once(keys: Any, args: Any) -> Any:
        result = await real_enqueue(keys, args)
        if not dropped:
            dropped.append(True)
            raise RedisConnectionError("the connection dropped before the reply")
        return result

    monkeypatch.setattr(records, "_enqueue", reply_lost_once)
    chunks = await stack.generate(greedy([1, 7, 7, 7], 4, request_id="sent-twice"))
    assert dropped and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(joined_tokens(chunks)) == 4
