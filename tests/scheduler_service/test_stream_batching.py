"""Token-stream batching end to end: fewer stream entries, the same tokens for every client.

The executor holds the tokens (its rules: tests/executor_service/test_token_batching.py); the
scheduler records each report's chunks as they come, merging consecutive reports drained together."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import redis

from common.keys import KeySchema
from common.lifecycle import FinishReason
from common.pb import executor_pb2 as epb
from common.pb import generate_pb2 as pb
from common.redis_client import connect
from common.sampling_params import SamplingParams
from scheduler_service.executor_link import ExecutorLink
from scheduler_service.report_writes import coalesce
from scheduler_service.requests import NewRequest, TokenEvent
from scheduler_service.store import Store
from scheduler_service.store.step_publisher import StepWrite
from tests.conftest import RedisServer
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.scheduler_service.test_end_to_end import greedy, random_prompts
from tests.stack import joined_tokens, stack_config, start_stack


async def test_handed_back_request_keeps_the_tokens_that_rode_on_its_preemption(redis_url: str) -> None:
    """A preempted request resumes after every token the executor made: the executor sends what it
    held with the preemption, and the link records those tokens before it hands the request back."""
    client = connect(redis_url)
    try:
        store = Store(client, KeySchema(), request_ttl_s=60)
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        await store.requests.enqueue(NewRequest("hb", (1, 5, 6), params, 5, "t", 0, 0), 0.0, 100)
        link = ExecutorLink(
            "exec-x", "unused:0", store, stack_config(redis_url, Path(".")).scheduler, lambda _queue_moved: None,
            stream_interval=(16, 0),
        )  # fmt: skip
        claimed = await store.requests.claim("hb", "exec-x", link.owner)
        assert claimed is not None
        link.admit(claimed)
        await link._on_reports([epb.StepReport(tokens=[epb.TokenDelta(request_id="hb", token_ids=[40], index=0)])])
        assert await store.requests.tokens_between("hb", 0, 50) == (40,)  # the first token went out at once
        held = epb.TokenDelta(request_id="hb", token_ids=[41, 42, 43, 44], index=1)
        await link._on_reports([epb.StepReport(tokens=[held], preempted=["hb"])])
        assert await store.requests.tokens_between("hb", 0, 50) == (40, 41, 42, 43, 44)
        assert (await store.requests.get("hb") or {})["state"] == "QUEUED"
        events = await store.streams.read_events("hb", "0", 100)
        assert [(e.index, e.token_ids) for _, e in events] == [(0, (40,)), (1, (41, 42, 43, 44))]
    finally:
        await client.aclose()


async def _run(
    redis_url: str, model_dir: Path, prompts: list[list[int]], lengths: list[int], **dist: int
) -> tuple[list[list[int]], list[int], list[int]]:
    config = stack_config(redis_url, model_dir, distributed=dist)
    stack = await start_stack(config)
    try:
        requests = [greedy(p, n, request_id=f"b-{i}") for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
        results = await asyncio.gather(*(stack.generate(r) for r in requests))
    finally:
        await stack.stop()
    direct = redis.Redis.from_url(redis_url, decode_responses=True)
    entries = [int(direct.xlen(f"baton:req:b-{i}:out")) for i in range(len(prompts))]
    direct.close()
    return [joined_tokens(chunks) for chunks in results], [len(chunks) for chunks in results], entries


async def test_batched_streams_match_the_unbatched_and_greedy_reference(
    redis_server: RedisServer, tiny_model_dir: Path
) -> None:
    prompts = random_prompts(8, seed=41)
    rng = random.Random(5)
    lengths = [rng.randrange(24, 64) for _ in prompts]
    redis_server.flush()
    plain, _, plain_entries = await _run(redis_server.url, tiny_model_dir, prompts, lengths)
    redis_server.flush()
    batched, batched_chunks, batched_entries = await _run(
        redis_server.url, tiny_model_dir, prompts, lengths, stream_interval_tokens=8, stream_interval_ms=10_000
    )
    assert batched == plain
    reference_model = load_reference_model(tiny_model_dir)
    for i, got in enumerate(batched):
        assert_matches_reference(got, reference_greedy(reference_model, prompts[i], lengths[i]), f"prompt {i}")
    for i, n in enumerate(lengths):
        # first token, then one entry per 8, the remainder on the final one
        assert batched_entries[i] <= 2 + (n - 1) // 8, (i, batched_entries[i], n)
        assert batched_chunks[i] == batched_entries[i]
    assert sum(batched_entries) * 3 < sum(plain_entries), (batched_entries, plain_entries)


def test_coalesce_merges_each_requests_contiguous_events_in_order() -> None:
    usage: dict[str, float] = {"completion_tokens": 3}
    writes = [
        StepWrite("a", TokenEvent(0, (1,), "x")),
        StepWrite("b", TokenEvent(4, (7,), "p")),
        StepWrite("a", TokenEvent(1, (2,), "y")),
        StepWrite("b", TokenEvent(9, (8,), "q")),  # not contiguous: Redis judges it on its own
        StepWrite("a", TokenEvent(2, (3,), "z", FinishReason.LENGTH, usage)),
        StepWrite("a", TokenEvent(3, (4,), "late")),  # after a final event: kept apart
    ]
    assert coalesce(writes) == [
        StepWrite("a", TokenEvent(0, (1, 2, 3), "xyz", FinishReason.LENGTH, usage)),
        StepWrite("b", TokenEvent(4, (7,), "p")),
        StepWrite("b", TokenEvent(9, (8,), "q")),
        StepWrite("a", TokenEvent(3, (4,), "late")),
    ]


async def test_a_requests_own_interval_chunks_its_stream_and_keeps_its_tokens(
    redis_url: str, tiny_model_dir: Path
) -> None:
    stack = await start_stack(stack_config(redis_url, tiny_model_dir))
    try:
        prompt = random_prompts(1, seed=43)[0]
        plain = await stack.generate(greedy(prompt, 21))
        request = greedy(prompt, 21)
        request.params.stream_interval_tokens = 5
        chunked = await stack.generate(request)
        assert joined_tokens(chunked) == joined_tokens(plain)
        assert "".join(c.text for c in chunked) == "".join(c.text for c in plain)
        # first token at once, then 5 at a time, the remainder (0 to 4 tokens) on the final one
        assert [len(c.token_ids) for c in chunked][:5] == [1, 5, 5, 5, 5]
        assert len(chunked) <= 6 < len(plain)
        assert chunked[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        await stack.stop()
