"""Token-stream batching: fewer stream entries, the same tokens for every client."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import redis

from common.keys import KeySchema
from common.lifecycle import FinishReason
from common.pb import executor_pb2 as epb
from common.pb import generate_pb2 as pb
from common.redis_client import connect
from common.sampling_params import SamplingParams
from scheduler_service.executor_link import ExecutorLink
from scheduler_service.request_store import RequestStore
from scheduler_service.requests import NewRequest, TokenEvent
from scheduler_service.step_publishing import StepWrite
from scheduler_service.stream_batching import StreamBatcher, StreamInterval, coalesce
from tests.conftest import RedisServer
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.scheduler_service.test_end_to_end import greedy, random_prompts
from tests.stack import joined_tokens, stack_config, start_stack


def _step(rid: str, index: int, tokens: tuple[int, ...], final: bool = False) -> StepWrite:
    reason = FinishReason.LENGTH if final else FinishReason.NONE
    text = "".join(f"<{t}>" for t in tokens)
    return StepWrite(rid, TokenEvent(index, tokens, text, reason, {"completion_tokens": 1.0} if final else {}))


def _flatten(writes: list[StepWrite]) -> tuple[list[int], str]:
    tokens: list[int] = []
    text = ""
    for write in writes:
        assert write.event.index == len(tokens), "a batched event must start where the last ended"
        tokens.extend(write.event.token_ids)
        text += write.event.text
    return tokens, text


def test_interval_one_passes_every_step_through() -> None:
    batcher = StreamBatcher(StreamInterval())
    steps = [_step("r", i, (i,)) for i in range(5)]
    assert [out for s in steps for out in batcher.offer(s, 0.0)] == steps
    assert batcher.due(100.0) == []


def test_first_event_at_once_then_every_n_tokens_and_the_rest_on_finish() -> None:
    batcher = StreamBatcher(StreamInterval(tokens=4))
    out = [batcher.offer(_step("r", i, (10 + i,), final=(i == 9)), 0.0) for i in range(10)]
    sizes = [[len(w.event.token_ids) for w in o] for o in out]
    # token 0 at once; 1-4 as one event; 5-8 as one; 9 alone on the final event.
    assert sizes == [[1], [], [], [], [4], [], [], [], [4], [1]]
    flat = [w for o in out for w in o]
    tokens, text = _flatten(flat)
    assert tokens == [10 + i for i in range(10)]
    assert text == "".join(f"<{10 + i}>" for i in range(10))
    assert flat[-1].event.finish_reason is FinishReason.LENGTH
    assert flat[-1].event.usage == {"completion_tokens": 1.0}


def test_a_request_may_ask_for_a_coarser_interval_than_the_servers() -> None:
    batcher = StreamBatcher(StreamInterval())  # the server streams every step
    batcher.set_interval("coarse", 4)
    batcher.set_interval("fine", 1)  # not coarser than the server's: nothing to remember
    assert batcher.batching
    coarse = [batcher.offer(_step("coarse", i, (i,), final=(i == 6)), 0.0) for i in range(7)]
    fine = [batcher.offer(_step("fine", i, (i,)), 0.0) for i in range(3)]
    assert [[len(w.event.token_ids) for w in o] for o in coarse] == [[1], [], [], [], [4], [], [2]]
    assert [[len(w.event.token_ids) for w in o] for o in fine] == [[1], [1], [1]]
    assert not batcher.batching, "a finished request's own interval is forgotten"
    batcher.set_interval("handed-back", 8)
    batcher.take("handed-back")
    assert not batcher.batching


def test_the_executor_may_hold_a_chunk_but_never_past_a_time_bound() -> None:
    untimed = StreamBatcher(StreamInterval(tokens=4))
    untimed.set_interval("coarse", 16)
    assert (untimed.executor_may_hold("coarse"), untimed.executor_may_hold("other")) == (16, 4)
    timed = StreamBatcher(StreamInterval(tokens=4, ms=20))
    timed.set_interval("coarse", 16)
    assert (timed.executor_may_hold("coarse"), timed.executor_may_hold("other")) == (1, 1)


def test_final_event_carries_everything_waiting() -> None:
    batcher = StreamBatcher(StreamInterval(tokens=100))
    assert len(batcher.offer(_step("r", 0, (1,)), 0.0)) == 1
    assert batcher.offer(_step("r", 1, (2, 3)), 0.0) == []
    final = batcher.offer(_step("r", 3, (4,), final=True), 0.0)
    assert [(w.event.index, w.event.token_ids) for w in final] == [(1, (2, 3, 4))]
    assert final[0].event.finish_reason is FinishReason.LENGTH
    assert batcher.waiting_requests == 0


def test_time_limit_flushes_a_request_without_news() -> None:
    batcher = StreamBatcher(StreamInterval(tokens=100, ms=50))
    batcher.offer(_step("r", 0, (1,)), 0.0)
    assert batcher.offer(_step("r", 1, (2,)), 1.0) == []
    assert batcher.due(1.049) == []
    due = batcher.due(1.05)
    assert [(w.event.index, w.event.token_ids) for w in due] == [(1, (2,))]
    assert batcher.due(5.0) == []


def test_take_hands_over_what_waits_and_forgets_the_request() -> None:
    batcher = StreamBatcher(StreamInterval(tokens=8))
    batcher.offer(_step("r", 0, (1,)), 0.0)
    batcher.offer(_step("r", 1, (2,)), 0.0)
    taken = batcher.take("r")
    assert taken is not None and (taken.event.index, taken.event.token_ids) == (1, (2,))
    assert batcher.take("r") is None
    # Resumed later (say on this link again), its first event goes out at once again.
    assert len(batcher.offer(_step("r", 2, (3,)), 0.0)) == 1


def test_a_gap_is_not_merged_over() -> None:
    batcher = StreamBatcher(StreamInterval(tokens=8))
    batcher.offer(_step("r", 0, (1,)), 0.0)
    batcher.offer(_step("r", 1, (2,)), 0.0)
    out = batcher.offer(_step("r", 5, (6,), final=True), 0.0)
    assert [(w.event.index, w.event.token_ids) for w in out] == [(1, (2,)), (5, (6,))]


def test_random_steps_reassemble_exactly() -> None:
    rng = random.Random(7)
    for trial in range(50):
        batcher = StreamBatcher(StreamInterval(tokens=rng.randrange(1, 10), ms=rng.choice([0, 5])))
        expected: dict[str, list[int]] = {f"r{k}": [] for k in range(4)}
        emitted: dict[str, list[StepWrite]] = {rid: [] for rid in expected}
        now = 0.0
        for _ in range(60):
            now += rng.random() * 0.004
            for rid in expected:
                if rng.random() < 0.3:
                    continue
                tokens = tuple(rng.randrange(100) for _ in range(rng.randrange(1, 3)))
                for w in batcher.offer(_step(rid, len(expected[rid]), tokens), now):
                    emitted[w.request_id].append(w)
                expected[rid].extend(tokens)
            for w in batcher.due(now):
                emitted[w.request_id].append(w)
        for rid in expected:
            for w in batcher.offer(_step(rid, len(expected[rid]), (), final=True), now):
                emitted[w.request_id].append(w)
            assert _flatten(emitted[rid])[0] == expected[rid], f"trial {trial}, {rid}"
            assert emitted[rid][-1].event.finish_reason is FinishReason.LENGTH


def test_interval_is_validated() -> None:
    with pytest.raises(ValueError):
        StreamInterval(tokens=0)
    with pytest.raises(ValueError):
        StreamInterval(tokens=2, ms=-1)


async def test_handed_back_request_keeps_the_tokens_that_waited(redis_url: str) -> None:
    """A preempted request resumes after every token the executor made, batched or not."""
    client = connect(redis_url)
    try:
        store = RequestStore(client, KeySchema(), request_ttl_s=60)
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        await store.enqueue(NewRequest("hb", (1, 5, 6), params, 5, "t", 0, 0), 0.0, 100)
        link = ExecutorLink(
            "exec-x", "unused:0", store, stack_config(redis_url, Path(".")).scheduler, lambda _queue_moved: None,
            stream_interval=StreamInterval(tokens=16),
        )  # fmt: skip
        claimed = await store.claim("hb", "exec-x", link.owner)
        assert claimed is not None
        link.admit(claimed)
        for i in range(5):
            await link._on_reports(
                [epb.StepReport(tokens=[epb.TokenDelta(request_id="hb", token_ids=[40 + i], index=i)])]
            )
        assert await store.tokens_between("hb", 0, 50) == (40,)  # only the first went out
        link.requests.pop("hb")
        await link.hand_back("hb")
        assert await store.tokens_between("hb", 0, 50) == (40, 41, 42, 43, 44)
        assert (await store.get("hb") or {})["state"] == "QUEUED"
        events = await store.read_events("hb", "0", 100)
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
    usage = {"completion_tokens": 3}
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
