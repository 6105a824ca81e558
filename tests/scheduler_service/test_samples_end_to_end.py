"""Several samples of one prompt (``SamplingParams.n``) end to end through gRPC: a real redis-server,
two executors with prefix caching, the scheduler, the tiny model."""

from __future__ import annotations

import random
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from baton.dev import free_port
from common.metrics import serve_metrics
from common.pb import generate_pb2 as pb
from tests.conftest import RedisServer
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.stack import Stack, eventually, stack_config, start_stack

BLOCK = 16  # the executors' KV block size


@pytest.fixture(scope="module")
async def stack(redis_server: RedisServer, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    # One stack for the module (starting executors is the slow part); each test uses its own ids and prompts.
    redis_server.flush()
    running = await start_stack(stack_config(redis_server.url, tiny_model_dir), executors=2)
    yield running
    await running.stop()


@pytest.fixture(scope="module")
def metrics_ports(stack: Stack) -> list[int]:
    return [serve_metrics(ex.metrics.registry, free_port(), host="127.0.0.1") for ex in stack.executors]


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(5, 8000) for _ in range(length - 1)]


def sampled(request_id: str, ids: list[int], n: int, seed: int | None, max_tokens: int = 12) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, n=n)
    if seed is not None:
        params.seed = seed
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=ids, params=params)


def by_sample(chunks: list[pb.GenerateResponse]) -> dict[int, list[pb.GenerateResponse]]:
    out: dict[int, list[pb.GenerateResponse]] = {}
    for chunk in chunks:
        out.setdefault(chunk.sample_index, []).append(chunk)
    return out


def tokens(chunks: list[pb.GenerateResponse]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def _counter(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def prefix_cache(ports: list[int]) -> tuple[float, float]:
    """Prompt tokens the executors' admissions looked up, and found cached, so far (all executors)."""
    queries = sum(_counter(p, "baton:prefix_cache_queries_total") for p in ports)
    hits = sum(_counter(p, "baton:prefix_cache_hits_total") for p in ports)
    return queries, hits


async def test_three_seeded_samples_are_reproducible_and_each_is_its_own_seed(stack: Stack) -> None:
    ids = prompt(20, seed=1)
    first = await stack.generate(sampled("seeded-a", ids, 3, seed=40))
    samples = by_sample(first)
    assert sorted(samples) == [0, 1, 2]
    assert {c.request_id for c in first} == {"seeded-a"}
    for chunks in samples.values():
        assert [c.index for c in chunks] == sorted(c.index for c in chunks)
        assert len(tokens(chunks)) == 12
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert all(c.finish_reason == pb.FINISH_REASON_NONE for c in chunks[:-1])
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (20, 12)
    outputs = [tokens(samples[k]) for k in range(3)]
    assert len({tuple(o) for o in outputs}) == 3, "each sample has its own seed"
    again = by_sample(await stack.generate(sampled("seeded-b", ids, 3, seed=40)))
    assert [tokens(again[k]) for k in range(3)] == outputs
    # Sample k samples with seed + k: a request of one sample with that seed gives the same.
    alone = by_sample(await stack.generate(sampled("seeded-c", ids, 1, seed=42)))
    assert tokens(alone[0]) == outputs[2]


async def test_complete_returns_every_sample_with_sample_0_at_the_top(stack: Stack) -> None:
    ids = prompt(24, seed=2)
    whole = await stack.stub.Complete(sampled("complete-a", ids, 3, seed=7))
    streamed = by_sample(await stack.generate(sampled("complete-b", ids, 3, seed=7)))
    assert whole.request_id == "complete-a" and whole.sample_index == 0
    assert [s.sample_index for s in whole.samples] == [0, 1, 2]
    assert [s.request_id for s in whole.samples] == ["complete-a", "complete-a~1", "complete-a~2"]
    for k, sample in enumerate(whole.samples):
        assert list(sample.token_ids) == tokens(streamed[k])
        assert sample.text == "".join(c.text for c in streamed[k])
        assert sample.finish_reason == pb.FINISH_REASON_LENGTH and sample.usage.completion_tokens == 12
    assert list(whole.token_ids) == list(whole.samples[0].token_ids) and whole.text == whole.samples[0].text
    single = await stack.stub.Complete(sampled("complete-one", ids, 1, seed=7))
    assert not single.samples and list(single.token_ids) == list(whole.token_ids)


async def test_samples_of_a_long_prompt_compute_its_full_blocks_once_on_one_executor(
    stack: Stack, metrics_ports: list[int], tiny_model_dir: Path
) -> None:
    n, length, output = 4, 5 * BLOCK + 6, 8
    ids = prompt(length, seed=3)  # a prompt no executor has seen
    queries, hits = prefix_cache(metrics_ports)
    greedy = pb.GenerateRequest(
        request_id="shared", prompt_token_ids=ids, params=pb.SamplingParams(max_tokens=output, ignore_eos=True, n=n)
    )
    samples = by_sample(await stack.generate(greedy))
    status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id="shared"))
    assert [s.request_id for s in status.samples] == ["shared", "shared~1", "shared~2", "shared~3"]
    assert len({s.executor_id for s in status.samples}) == 1, "the samples share one executor"

    async def counted() -> bool:
        return prefix_cache(metrics_ports)[0] - queries >= n * length

    await eventually(counted, "the executors' counters to report every admission")
    queries_now, hits_now = prefix_cache(metrics_ports)
    assert queries_now - queries == n * length
    # Sample 0 computed the prompt; each later sample found its 5 full blocks cached and computed
    # only the last 6 tokens: the full blocks were computed once.
    assert hits_now - hits == (n - 1) * 5 * BLOCK
    # Greedy samples are identical, and those that read the cached blocks equal model.generate.
    reference = reference_greedy(load_reference_model(tiny_model_dir), ids, output)
    for k in range(n):
        assert_matches_reference(tokens(samples[k]), reference, f"sample {k}")


async def test_cancel_of_the_request_cancels_every_sample(stack: Stack) -> None:
    call = stack.stub.Generate(sampled("cancel-all", prompt(10, seed=4), 3, seed=1, max_tokens=3000))
    chunks = aiter(call)
    got = [await anext(chunks)]
    reply = await stack.stub.Cancel(pb.CancelRequest(request_id="cancel-all"))
    assert reply.state in (pb.REQUEST_STATE_RUNNING, pb.REQUEST_STATE_ASSIGNED)
    got += [chunk async for chunk in chunks]
    ends = {c.sample_index: c.finish_reason for c in got if c.finish_reason}
    assert ends == dict.fromkeys(range(3), pb.FINISH_REASON_CANCELLED)

    async def all_cancelled() -> bool:
        status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id="cancel-all"))
        return [s.state for s in status.samples] == [pb.REQUEST_STATE_CANCELLED] * 3

    await eventually(all_cancelled, "every sample to be recorded CANCELLED")


async def test_a_later_sample_outliving_sample_0s_record_is_still_cancelled_by_the_requests_id(
    stack: Stack,
) -> None:
    """Sample 0 ended and its record expired (it named the sample count) while sample 1 goes on."""
    call = stack.stub.Generate(sampled("outlived", prompt(10, seed=6), 2, seed=1, max_tokens=3000))
    chunks = aiter(call)
    got = [await anext(chunks)]
    frontend = stack.scheduler.frontend
    await frontend._cancel_one("outlived")  # sample 0 alone ends, its client reads its end...
    while not any(c.sample_index == 0 and c.finish_reason for c in got):
        got.append(await anext(chunks))
    keys = frontend.store.keys
    await frontend.store.redis.delete(keys.request("outlived"), keys.tokens("outlived"))  # ...and it expires
    reply = await stack.stub.Cancel(pb.CancelRequest(request_id="outlived"))
    assert reply.state in (pb.REQUEST_STATE_RUNNING, pb.REQUEST_STATE_ASSIGNED, pb.REQUEST_STATE_CANCELLED)
    got += [chunk async for chunk in chunks]
    assert {c.sample_index: c.finish_reason for c in got if c.finish_reason} == dict.fromkeys(
        range(2), pb.FINISH_REASON_CANCELLED
    )
    with pytest.raises(grpc.aio.AioRpcError) as gone:  # no sample of it is left
        await stack.stub.Cancel(pb.CancelRequest(request_id="never-was"))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_client_that_walks_away_cancels_every_sample(stack: Stack) -> None:
    call = stack.stub.Generate(sampled("walks-away", prompt(10, seed=5), 2, seed=1, max_tokens=3000))
    await call.read()
    call.cancel()

    async def all_cancelled() -> bool:
        status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id="walks-away"))
        return [s.state for s in status.samples] == [pb.REQUEST_STATE_CANCELLED] * 2

    await eventually(all_cancelled, "every sample to be recorded CANCELLED")


async def test_resume_follows_every_sample_or_one(stack: Stack) -> None:
    done = by_sample(await stack.generate(sampled("resumed", prompt(12, seed=6), 2, seed=3)))
    replay = by_sample([c async for c in stack.stub.Resume(pb.ResumeRequest(request_id="resumed"))])
    assert {k: tokens(v) for k, v in replay.items()} == {k: tokens(v) for k, v in done.items()}
    one = [c async for c in stack.stub.Resume(pb.ResumeRequest(request_id="resumed~1", from_index=5))]
    assert {(c.request_id, c.sample_index) for c in one} == {("resumed~1", 1)}
    assert tokens(one) == tokens(done[1])[5:] and one[-1].finish_reason == pb.FINISH_REASON_LENGTH
    status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id="resumed~1"))
    assert status.sample_index == 1 and status.tokens_generated == 12 and not status.samples


async def test_a_batch_stream_tags_each_samples_events(stack: Stack) -> None:
    async def requests() -> AsyncIterator[pb.GenerateRequest]:
        yield sampled("batch-samples", prompt(8, seed=7), 2, seed=9)
        yield sampled("batch-single", prompt(8, seed=8), 1, seed=9)

    events = [e async for message in stack.stub.GenerateBatch(requests()) for e in message.events]
    assert all(e.error_code == 0 for e in events)
    finished = {(e.position, e.response.sample_index) for e in events if e.response.finish_reason}
    assert finished == {(0, 0), (0, 1), (1, 0)}


@pytest.mark.parametrize(
    ("request_id", "n", "message"),
    [("too-many", 129, "n must lie in"), ("job~1", 2, "request_id")],
)
async def test_bad_sample_requests_are_invalid_argument(stack: Stack, request_id: str, n: int, message: str) -> None:
    request = sampled(request_id, [1, 5, 6], n, seed=1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.Complete(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in str(err.value.details())


async def test_sample_seeds_wrap_past_the_end_of_the_seed_range(stack: Stack) -> None:
    # Sample 1 of seed 2**64 - 1 samples with seed 0, as vLLM's seed + k wraps in torch's generator.
    wrapped = await stack.stub.Complete(sampled("seed-wraps", [1, 5, 6], 2, seed=2**64 - 1))
    zero = await stack.stub.Complete(sampled("seed-zero", [1, 5, 6], 1, seed=0))
    by_index = {s.sample_index: list(s.token_ids) for s in wrapped.samples}
    assert by_index[1] == list(zero.token_ids)
