"""GenerateBatch end to end: real redis-server, executor and scheduler, the tiny model."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import grpc
import redis.asyncio as aioredis

from common.pb import generate_pb2 as pb
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.scheduler_service.test_end_to_end import greedy, random_prompts
from tests.stack import Stack, eventually, stack_config, start_stack


async def run_batch(stack: Stack, requests: list[pb.GenerateRequest]) -> list[pb.GenerateBatchResponse]:
    return [message async for message in stack.stub.GenerateBatch(iter(requests))]


def by_position(messages: list[pb.GenerateBatchResponse]) -> dict[int, list[pb.BatchEvent]]:
    events: dict[int, list[pb.BatchEvent]] = defaultdict(list)
    for message in messages:
        for event in message.events:
            events[event.position].append(event)
    return events


async def test_a_batch_streams_each_request_exactly_as_generate_alone(stack: Stack, tiny_model_dir: Path) -> None:
    prompts = random_prompts(8, seed=21)
    lengths = [8 + 5 * i for i in range(len(prompts))]
    messages = await run_batch(stack, [greedy(p, n) for p, n in zip(prompts, lengths, strict=True)])
    events = by_position(messages)
    assert sorted(events) == list(range(len(prompts)))
    reference_model = load_reference_model(tiny_model_dir)
    for position, mine in events.items():
        responses = [event.response for event in mine]
        assert all(event.error_code == 0 for event in mine)
        assert len({r.request_id for r in responses}) == 1
        indexes = [r.index for r in responses]
        assert indexes == sorted(indexes)
        assert [r.finish_reason for r in responses[:-1]] == [pb.FINISH_REASON_NONE] * (len(responses) - 1)
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == lengths[position]
        got = [token for r in responses for token in r.token_ids]
        want = reference_greedy(reference_model, prompts[position], lengths[position])
        assert_matches_reference(got, want, f"position {position}")
    # The point of the call: a step's news for several requests travels in one message.
    assert len(messages) < sum(len(mine) for mine in events.values())


async def test_each_samples_first_event_carries_what_generates_first_message_does(stack: Stack) -> None:
    """The prompt's size in the usage, and its ids when asked (return_prompt_token_ids), on the
    first event of every sample, as a Generate stream's first message of each sample has them."""
    asked = greedy([1, 5, 6, 7], 3)
    asked.return_prompt_token_ids = True
    asked.params.n = 2
    plain = greedy([1, 8, 9], 2)
    events = by_position(await run_batch(stack, [asked, plain]))
    for position, prompt, with_ids in ((0, [1, 5, 6, 7], True), (1, [1, 8, 9], False)):
        firsts: dict[int, pb.GenerateResponse] = {}
        for event in events[position]:
            firsts.setdefault(event.response.sample_index, event.response)
        assert sorted(firsts) == ([0, 1] if position == 0 else [0])
        for response in firsts.values():
            assert response.usage.prompt_tokens == len(prompt)
            assert list(response.prompt_token_ids) == (prompt if with_ids else [])


async def test_a_bad_request_fails_alone(stack: Stack) -> None:
    empty = pb.GenerateRequest(params=pb.SamplingParams(max_tokens=4))
    too_hot = greedy([1, 5, 6], 4)
    too_hot.params.temperature = -1.0
    requests = [greedy([1, 7, 8, 9], 6), empty, too_hot, greedy([1, 10, 11], 5)]
    events = by_position(await run_batch(stack, requests))
    for bad in (1, 2):
        assert len(events[bad]) == 1
        assert events[bad][0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert events[bad][0].error_message
        assert not events[bad][0].HasField("response")
    for good, length in ((0, 6), (3, 5)):
        assert events[good][-1].response.finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(e.response.token_ids) for e in events[good]) == length


async def test_an_undecodable_message_fails_alone(stack: Stack) -> None:
    good = greedy([1, 7, 8], 4).SerializeToString()
    bad_utf8 = b"\x12\x02\xff\xfe"  # field 2 (prompt), a string that is not UTF-8
    call = stack.channel.stream_stream(
        "/baton.v1.Generation/GenerateBatch",
        request_serializer=lambda raw: raw,
        response_deserializer=pb.GenerateBatchResponse.FromString,
    )
    events = by_position([message async for message in call(iter([bad_utf8, good]))])
    assert events[0][0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert events[1][-1].response.finish_reason == pb.FINISH_REASON_LENGTH


async def test_an_empty_batch_ends_at_once(stack: Stack) -> None:
    assert await asyncio.wait_for(run_batch(stack, []), 10.0) == []


async def test_cancelling_the_stream_cancels_its_running_requests(stack: Stack) -> None:
    call = stack.stub.GenerateBatch(iter([greedy([1, 5, 6, 7], 4000), greedy([1, 9, 9], 4000)]))
    request_ids: set[str] = set()
    async for message in call:
        request_ids.update(e.response.request_id for e in message.events if e.response.request_id)
        if len(request_ids) == 2:
            break
    call.cancel()

    async def all_cancelled() -> bool:
        for request_id in request_ids:
            status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id=request_id))
            if status.state != pb.REQUEST_STATE_CANCELLED:
                return False
        return True

    await eventually(all_cancelled, "both requests to be cancelled")


async def test_requests_beyond_the_stream_cap_are_refused_and_leave_nothing(
    redis_url: str, tiny_model_dir: Path
) -> None:
    config = stack_config(redis_url, tiny_model_dir, scheduler={"request_level": {"max_batch_stream_requests": 2}})
    capped = await start_stack(config)
    try:
        requests = [greedy(p, 40, request_id=f"cap-{i}") for i, p in enumerate(random_prompts(4, seed=8))]
        events = by_position(await run_batch(capped, requests))
        for position in (0, 1):
            assert events[position][-1].response.finish_reason == pb.FINISH_REASON_LENGTH
        for position in (2, 3):  # sent while the first two were still running
            (refused,) = events[position]
            assert refused.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "2 unfinished requests" in refused.error_message
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            assert [k async for k in client.scan_iter(match="*cap-2*")] == []
            assert [k async for k in client.scan_iter(match="*cap-3*")] == []
        finally:
            await client.aclose()
    finally:
        await capped.stop()
