"""Sampling controls and log probabilities end to end through gRPC: real redis-server, real executor
and scheduler servers, the tiny model, against the model's own logits."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoTokenizer, GenerationMixin

from common.pb import generate_pb2 as pb
from common.sampling_params import SamplingParams
from scheduler_service.validation import bad_words_token_ids
from tests.conftest import RedisServer
from tests.executor_service.reference import assert_matches_reference, load_reference_model
from tests.executor_service.test_logits_processing import hf_greedy, reference_loop
from tests.executor_service.test_token_logprobs import TOLERANCE, model_logprobs
from tests.scheduler_service.test_end_to_end import _first_chunks, random_prompts
from tests.stack import Stack, joined_tokens, stack_config, start_stack


@pytest.fixture(scope="module")
async def stack(redis_server: RedisServer, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    # One stack for the module: no test here depends on a clean Redis. One request runs at a time,
    # and a priority gap of 3 preempts (for the preemption test).
    redis_server.flush()
    scheduler = {"batch_level": {"max_batch_size": 1}, "request_level": {"preempt_priority_gap": 3}}
    running = await start_stack(stack_config(redis_server.url, tiny_model_dir, scheduler=scheduler))
    yield running
    await running.stop()


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> GenerationMixin:
    return load_reference_model(tiny_model_dir)


def request(prompt: list[int], **params: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=prompt, params=pb.SamplingParams(ignore_eos=True, **params))  # type: ignore[arg-type]


def assert_logprobs(
    got: list[pb.PositionLogprobs], expected: torch.Tensor, tokens: list[int], num_top: int, decode: object
) -> None:
    """Entry i names ``tokens[i]``, scored by row i of ``expected``, with ``num_top`` alternatives."""
    assert len(got) == len(tokens)
    for i, (entry, token) in enumerate(zip(got, tokens, strict=True)):
        assert entry.token.token_id == token and entry.token.HasField("logprob")
        assert entry.token.logprob == pytest.approx(float(expected[i, token]), abs=TOLERANCE)
        assert entry.token.text == decode([token])  # type: ignore[operator]
        assert len(entry.top) == num_top
        top = torch.topk(expected[i], num_top)
        assert [t.logprob for t in entry.top] == pytest.approx(top.values.tolist(), abs=TOLERANCE)
        for alt in entry.top:
            assert float(expected[i, alt.token_id]) == pytest.approx(alt.logprob, abs=TOLERANCE)
        assert [alt.rank for alt in entry.top] == list(range(1, num_top + 1))
        # vLLM's rank: how many tokens are at least as likely (tokens within the tolerance either side).
        value = float(expected[i, token])
        above, near = int((expected[i] > value + TOLERANCE).sum()), int((expected[i] >= value - TOLERANCE).sum())
        assert entry.token.HasField("rank") and above + 1 <= entry.token.rank <= near


async def test_logprobs_stream_complete_and_resume(stack: Stack, model: GenerationMixin, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = random_prompts(1, seed=41)[0]
    msg = request(prompt, max_tokens=10, logprobs=3, prompt_logprobs=2)
    chunks = await stack.generate(msg)
    tokens = joined_tokens(chunks)
    streamed = [entry for chunk in chunks for entry in chunk.logprobs]
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    expected = model_logprobs(model, prompt + tokens)
    assert_logprobs(streamed, expected[len(prompt) - 1 : -1], tokens, 3, tokenizer.decode)
    assert tokens == expected[len(prompt) - 1 : -1].argmax(dim=-1).tolist()

    prompt_entries = list(chunks[0].prompt_logprobs)
    assert all(not c.prompt_logprobs for c in chunks[1:])
    first = prompt_entries[0]
    assert first.token.token_id == prompt[0] and not first.token.HasField("logprob") and not first.top
    assert not first.token.HasField("rank")
    assert_logprobs(prompt_entries[1:], expected[: len(prompt) - 1], prompt[1:], 2, tokenizer.decode)

    whole = await stack.stub.Complete(msg)
    assert list(whole.logprobs) == streamed and list(whole.prompt_logprobs) == prompt_entries

    request_id = chunks[0].request_id
    replay = [c async for c in stack.stub.Resume(pb.ResumeRequest(request_id=request_id))]
    assert [e for c in replay for e in c.logprobs] == streamed and list(replay[0].prompt_logprobs) == prompt_entries
    tail = [c async for c in stack.stub.Resume(pb.ResumeRequest(request_id=request_id, from_index=4))]
    assert [e for c in tail for e in c.logprobs] == streamed[4:]
    assert not any(c.prompt_logprobs for c in tail)


async def test_batch_stream_carries_each_requests_logprobs(stack: Stack) -> None:
    prompts = random_prompts(2, seed=46)

    async def requests() -> AsyncIterator[pb.GenerateRequest]:
        yield request(prompts[0], max_tokens=3, logprobs=1, prompt_logprobs=0)
        yield request(prompts[1], max_tokens=3)

    events: dict[int, list[pb.GenerateResponse]] = {0: [], 1: []}
    async for message in stack.stub.GenerateBatch(requests()):
        for event in message.events:
            events[event.position].append(event.response)
    asked, plain = events[0], events[1]
    assert [len(r.logprobs) for r in asked] == [len(r.token_ids) for r in asked]
    assert len(asked[0].prompt_logprobs) == len(prompts[0])
    assert not any(r.logprobs or r.prompt_logprobs for r in plain)


async def test_requests_that_ask_for_nothing_get_no_logprobs(stack: Stack) -> None:
    chunks = await stack.generate(request(random_prompts(1, seed=42)[0], max_tokens=4))
    assert not any(c.logprobs or c.prompt_logprobs for c in chunks)


async def test_max_tokens_zero_scores_the_prompt(stack: Stack, model: GenerationMixin, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = random_prompts(1, seed=43)[0]
    whole = await stack.stub.Complete(request(prompt, max_tokens=0, prompt_logprobs=1))
    assert not whole.token_ids and not whole.logprobs and whole.text == ""
    assert whole.finish_reason == pb.FINISH_REASON_LENGTH
    assert whole.usage.completion_tokens == 0 and whole.usage.prompt_tokens == len(prompt)
    entries = list(whole.prompt_logprobs)
    assert len(entries) == len(prompt)
    assert_logprobs(entries[1:], model_logprobs(model, prompt)[:-1], prompt[1:], 1, tokenizer.decode)


async def test_penalties_match_hf_and_the_reference_loop(stack: Stack, model: GenerationMixin) -> None:
    prompt = random_prompts(1, seed=44)[0]
    got = joined_tokens(await stack.generate(request(prompt, max_tokens=20, repetition_penalty=1.3)))
    assert_matches_reference(got, hf_greedy(model, prompt, 20, repetition_penalty=1.3), "repetition")
    mixed = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "min_tokens": 4, "logit_bias": {33: 5.0}}
    got = joined_tokens(await stack.generate(request(prompt, max_tokens=20, **mixed)))
    params = SamplingParams(
        max_tokens=20, min_tokens=4, presence_penalty=1.5, frequency_penalty=0.5, logit_bias=((33, 5.0),)
    )
    assert_matches_reference(got, reference_loop(model, prompt, 20, params), "presence+frequency+bias")


async def test_stop_string_kept_with_include_stop_str_in_output(stack: Stack) -> None:
    prompt = random_prompts(1, seed=45)[0]
    free = await stack.stub.Complete(request(prompt, max_tokens=30))
    text = free.text
    stop = text[len(text) // 2 :][:3]
    if len(stop) < 3 or text.index(stop) == 0:
        pytest.skip("the generated text has no usable stop string")
    cut = await stack.stub.Complete(request(prompt, max_tokens=30, stop=[stop]))
    kept = await stack.stub.Complete(request(prompt, max_tokens=30, stop=[stop], include_stop_str_in_output=True))
    assert cut.text == text[: text.index(stop)]
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert cut.finish_reason == kept.finish_reason == pb.FINISH_REASON_STOP


async def test_allowed_tokens_and_bad_words_match_the_reference_loop(
    stack: Stack, model: GenerationMixin, tiny_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = random_prompts(1, seed=46)[0]
    free = joined_tokens(await stack.generate(request(prompt, max_tokens=16)))
    allowed = sorted(set(range(200, 600, 7)) | {free[3]})
    got = joined_tokens(await stack.generate(request(prompt, max_tokens=16, allowed_token_ids=allowed)))
    params = SamplingParams(max_tokens=16, ignore_eos=True, allowed_token_ids=tuple(allowed))
    assert_matches_reference(got, reference_loop(model, prompt, 16, params), "allowed_token_ids")
    assert set(got) <= set(allowed)

    words = [str(tokenizer.decode(free[2:4])).strip(), str(tokenizer.decode([free[0]])).strip()]
    banned = bad_words_token_ids(words, lambda word: tokenizer.encode(word, add_special_tokens=False), len(tokenizer))
    got = joined_tokens(await stack.generate(request(prompt, max_tokens=16, bad_words=words)))
    params = SamplingParams(max_tokens=16, ignore_eos=True, bad_words_token_ids=banned)
    assert_matches_reference(got, reference_loop(model, prompt, 16, params), "bad_words")
    for word in banned:
        assert all(got[i : i + len(word)] != list(word) for i in range(len(got))), word
    assert got != free


async def test_special_tokens_text_and_prompt_truncation_and_tokenising(stack: Stack, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = random_prompts(1, seed=47)[0]
    eos = tokenizer.eos_token_id
    forced = {"max_tokens": 2, "allowed_token_ids": [eos]}
    skipped = await stack.stub.Complete(request(prompt, **forced))
    kept = await stack.stub.Complete(request(prompt, skip_special_tokens=False, **forced))
    assert list(skipped.token_ids) == list(kept.token_ids) == [eos, eos]
    assert skipped.text == "" and kept.text == tokenizer.eos_token * 2

    chunks = await stack.generate(request(prompt, max_tokens=3, stream_interval_tokens=1))
    assert chunks[0].usage.prompt_tokens == len(prompt)  # the first message says the prompt's size
    assert chunks[-1].usage.prompt_tokens == len(prompt) and chunks[-1].usage.completion_tokens == 3

    whole = await stack.stub.Complete(request(prompt[-5:], max_tokens=8))
    cut = await stack.stub.Complete(request(prompt, max_tokens=8, truncate_prompt_tokens=5))
    assert cut.usage.prompt_tokens == 5 and list(cut.token_ids) == list(whole.token_ids)

    text = "the river ran"
    params = pb.SamplingParams(max_tokens=1)
    with_bos = await stack.stub.Complete(pb.GenerateRequest(prompt=text, params=params))
    bare = await stack.stub.Complete(pb.GenerateRequest(prompt=text, params=params, add_special_tokens=False))
    assert with_bos.usage.prompt_tokens == len(tokenizer(text).input_ids)
    assert bare.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
    assert bare.usage.prompt_tokens < with_bos.usage.prompt_tokens


async def test_a_request_its_bans_leave_nothing_ends_with_an_error(stack: Stack) -> None:
    prompt = random_prompts(1, seed=48)[0]
    stuck = request(prompt, max_tokens=8, min_tokens=3, stop_token_ids=[9], allowed_token_ids=[9])
    answer = await stack.stub.Complete(stuck)
    assert answer.finish_reason == pb.FINISH_REASON_ERROR and not answer.token_ids
    status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id=answer.request_id))
    assert status.state == pb.REQUEST_STATE_FAILED and "no token may be sampled" in status.error


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids has token ids outside"),
        ({"bad_words": [" "]}, "not only spaces"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1 or >= 1"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias has token ids outside"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs must lie in"),
        ({"max_tokens": 0}, "0 only with prompt_logprobs"),
    ],
)
async def test_bad_controls_are_invalid_arguments(stack: Stack, params: dict[str, object], message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.Complete(request([1, 5, 6], **params))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (err.value.details() or "")


async def test_preempted_request_resumes_with_exact_penalties_and_logprobs(
    stack: Stack, model: GenerationMixin
) -> None:
    """Preempted for a more important request, it resumes from the tokens Redis recorded: its
    penalties count them, so it produces what it would have produced uninterrupted."""
    prompt = [1, 11, 12, 13, 14, 15]
    params = {"frequency_penalty": 0.6, "repetition_penalty": 1.2, "logprobs": 1}
    victim = stack.stub.Generate(
        pb.GenerateRequest(
            request_id="victim",
            prompt_token_ids=prompt,
            priority=0,
            params=pb.SamplingParams(max_tokens=60, ignore_eos=True, **params),  # type: ignore[arg-type]
        )
    )
    first = await _first_chunks(victim, 3)
    vip = pb.GenerateRequest(prompt_token_ids=[1, 9, 9], priority=10, params=pb.SamplingParams(max_tokens=4))
    await stack.stub.Complete(vip)
    chunks = first + [chunk async for chunk in victim]
    record = await stack.scheduler.frontend.store.requests.get("victim")
    assert record is not None and int(record["preemptions"]) == 1
    tokens = joined_tokens(chunks)
    reference = SamplingParams(max_tokens=60, frequency_penalty=0.6, repetition_penalty=1.2)
    assert_matches_reference(tokens, reference_loop(model, prompt, 60, reference), "victim")
    entries = [e for c in chunks for e in c.logprobs]
    expected = model_logprobs(model, prompt + tokens)[len(prompt) - 1 : -1]
    assert [e.token.token_id for e in entries] == tokens
    got = [e.token.logprob for e in entries]
    assert got == pytest.approx([float(expected[i, t]) for i, t in enumerate(tokens)], abs=TOLERANCE)
    assert not math.isnan(sum(got))
