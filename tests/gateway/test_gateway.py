"""The gateway end to end: a real Baton stack, the gateway under uvicorn, the official `openai` client."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import re
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
import redis.asyncio as aioredis
import torch
from openai.types.chat import ChatCompletionMessageParam
from transformers import AutoTokenizer

from baton.cli import build_parser
from common.pb import generate_pb2 as pb
from gateway.app import create_app
from gateway.openai_tools import TOOL_CALL_PARSERS
from gateway.reasoning import REASONING_PARSERS
from tests.conftest import free_port
from tests.executor_service.reference import load_reference_model
from tests.executor_service.test_token_logprobs import model_logprobs
from tests.gateway.conftest import ALIAS, Served
from tests.gateway.serving import serve_gateway

# Greedy and past EOS, so outputs are deterministic and exactly max_tokens long (the tiny model may emit EOS early).
NO_EOS = {"ignore_eos": True}


async def _record(served: Served, request_id: str) -> dict[str, str]:
    store = aioredis.Redis.from_url(served.redis_url, decode_responses=True)
    try:
        record = await store.hgetall(f"{{baton}}:req:{request_id}")  # type: ignore[misc]
        return {str(k): str(v) for k, v in record.items()}
    finally:
        await store.aclose()


async def test_completion_whole(client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.choices[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


async def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(client: openai.AsyncOpenAI) -> None:
    prompt = "A prompt that fills several KV blocks: " + " ".join(f"w{i}" for i in range(60))
    outs = [
        await client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body=NO_EOS)
        for _ in range(2)
    ]
    details = [out.usage.prompt_tokens_details if out.usage else None for out in outs]
    assert details[0] is not None and details[0].cached_tokens == 0
    assert details[1] is not None and outs[1].usage is not None
    # The repeat read its prompt's whole blocks from the cache and computed the rest.
    assert 0 < (details[1].cached_tokens or 0) < outs[1].usage.prompt_tokens


async def test_completion_stream_joins_to_whole(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    stream = await client.completions.create(
        model="tiny",
        prompt="Once upon",
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        extra_body=NO_EOS,
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id != whole.id
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


async def test_completion_from_token_ids_matches_text(served: Served, client: openai.AsyncOpenAI) -> None:
    ids = list((await served.stack.stub.Tokenize(pb.TokenizeRequest(text="Hello there"))).token_ids)
    by_text = await client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=6, temperature=0, extra_body=NO_EOS
    )
    by_ids = await client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)


async def test_a_list_of_prompts_answers_each_as_alone(served: Served, client: openai.AsyncOpenAI) -> None:
    ids = list((await served.stack.stub.Tokenize(pb.TokenizeRequest(text="The mill"))).token_ids)
    prompts: list[Any] = ["Once upon", ids, "Hello there"]
    options: dict[str, Any] = {"max_tokens": 5, "temperature": 0, "n": 2, "logprobs": 1, "echo": True}
    alone = [await client.completions.create(model=ALIAS, prompt=p, extra_body=NO_EOS, **options) for p in prompts]
    batch = await client.completions.create(model=ALIAS, prompt=prompts, extra_body=NO_EOS, **options)
    assert [c.index for c in batch.choices] == list(range(6))  # prompt i's sample k at i * n + k
    for i, one in enumerate(alone):
        for k in range(2):
            got, want = batch.choices[2 * i + k], one.choices[k]
            assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
            assert got.logprobs is not None and want.logprobs is not None
            assert got.logprobs.tokens == want.logprobs.tokens
    assert batch.usage is not None and all(one.usage is not None for one in alone)
    assert batch.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone if one.usage)
    assert batch.usage.completion_tokens == 3 * 2 * 5
    # Streamed: each choice's chunks join to its whole text, and the usage comes last.
    stream = await client.completions.create(
        model=ALIAS,
        prompt=prompts,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
        **{k: v for k, v in options.items() if k != "logprobs"},
    )
    chunks = [chunk async for chunk in stream]
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert texts == {c.index: c.text for c in batch.choices}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30
    assert len({c.id for c in chunks}) == 1


async def test_stop_string_ends_the_text(client: openai.AsyncOpenAI) -> None:
    free = await client.completions.create(model="tiny", prompt="abc", max_tokens=30, temperature=0, extra_body=NO_EOS)
    text = free.choices[0].text
    stop = text[len(text) // 2 :][:3]
    if not stop.strip():
        pytest.skip("the generated text has no usable stop string")
    out = await client.completions.create(
        model="tiny", prompt="abc", max_tokens=30, stop=stop, temperature=0, extra_body=NO_EOS
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    # vLLM's stop_reason names what stopped it, whole and on a stream's finishing chunk; a stop
    # token by its id, the end-of-sequence token (and any other finish) by nothing.
    assert (out.choices[0].model_extra or {})["stop_reason"] == stop
    stream = await client.completions.create(
        model="tiny", prompt="abc", max_tokens=30, stop=stop, temperature=0, extra_body=NO_EOS, stream=True
    )
    finishing = [c.choices[0] async for c in stream if c.choices and c.choices[0].finish_reason]
    assert [(c.model_extra or {}).get("stop_reason") for c in finishing] == [stop]
    token = free.choices[0]
    assert (token.model_extra or {})["stop_reason"] is None and token.finish_reason == "length"
    ids = (
        await client.completions.create(
            model="tiny", prompt="abc", max_tokens=3, temperature=0, extra_body={"return_token_ids": True, **NO_EOS}
        )
    ).choices[0]
    stop_id = (ids.model_extra or {})["token_ids"][1]
    by_token = await client.completions.create(
        model="tiny", prompt="abc", max_tokens=30, temperature=0, extra_body={"stop_token_ids": [stop_id], **NO_EOS}
    )
    assert (by_token.choices[0].model_extra or {})["stop_reason"] == stop_id


def _chat_ids(model_dir: Path, messages: list[ChatCompletionMessageParam]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversation = cast(list[dict[str, str]], messages)
    return cast(list[int], tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False))


async def test_chat_whole_uses_the_models_chat_template(served: Served, client: openai.AsyncOpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    chat = await client.chat.completions.create(
        model=str(served.model_dir), messages=messages, max_tokens=10, temperature=0, extra_body=NO_EOS
    )
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    assert chat.model == str(served.model_dir)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    ids = _chat_ids(served.model_dir, messages)
    assert chat.usage is not None and (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(ids), 10)
    # The same prompt tokens as a completion give the same text: the gateway sent the messages, and
    # the scheduler rendered them with the model's template.
    same = await client.completions.create(model=ALIAS, prompt=ids, max_tokens=10, temperature=0, extra_body=NO_EOS)
    assert chat.choices[0].message.content == same.choices[0].text


async def test_chat_continues_a_begun_reply(served: Served, client: openai.AsyncOpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Well, the"},
    ]
    options = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}}
    chat = await client.chat.completions.create(
        model=ALIAS, messages=messages, max_tokens=8, temperature=0, extra_body={**NO_EOS, **options}
    )
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    conversation = cast(list[dict[str, str]], messages)
    ids = cast(list[int], tokenizer.apply_chat_template(conversation, continue_final_message=True, return_dict=False))
    same = await client.completions.create(model=ALIAS, prompt=ids, max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == same.choices[0].text
    # vLLM's chat echo: the continued message, then its continuation, whole or streamed.
    echoed = {**NO_EOS, **options, "echo": True}
    whole = await client.chat.completions.create(
        model=ALIAS, messages=messages, max_tokens=8, temperature=0, extra_body=echoed
    )
    assert whole.choices[0].message.content == "Well, the" + same.choices[0].text
    stream = await client.chat.completions.create(
        model=ALIAS, messages=messages, max_tokens=8, temperature=0, stream=True, extra_body=echoed
    )
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert streamed == whole.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="allow_request_chat_template"):  # not trusted here
        await client.chat.completions.create(
            model=ALIAS, messages=messages, max_tokens=2, extra_body={"chat_template": "{{ messages }}"}
        )
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):  # both: Baton refuses
        await client.chat.completions.create(
            model=ALIAS, messages=messages, max_tokens=2, extra_body={"continue_final_message": True}
        )


async def test_chat_stream_with_usage(served: Served, client: openai.AsyncOpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}]}]
    whole = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=9, temperature=0, extra_body=NO_EOS
    )
    stream = await client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        extra_body=NO_EOS,
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.model == "tiny" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    as_text: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me"}]  # the parts, joined
    assert chunks[-1].usage.prompt_tokens == len(_chat_ids(served.model_dir, as_text))


async def _sse_events(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_include_usage_stream_shape(served: Served, path: str) -> None:
    """OpenAI's shape: every chunk has ``usage: null`` but the last, which has no choices; without
    include_usage no chunk has a usage field."""
    body: dict[str, Any] = {"model": ALIAS, "max_tokens": 4, "temperature": 0, "stream": True, **NO_EOS}
    if path == "/v1/completions":
        body["prompt"] = "Hello"
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        plain = await _sse_events(http, path, body)
        counted = await _sse_events(http, path, {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in event for event in plain)
    assert all(event["usage"] is None and event["choices"] for event in counted[:-1])
    last = counted[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 4

    continuous = {"include_usage": True, "continuous_usage_stats": True}
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        running = await _sse_events(http, path, {**body, "stream_options": continuous})
    prompt = last["usage"]["prompt_tokens"]
    assert all(event["usage"]["prompt_tokens"] == prompt for event in running)
    counts = [event["usage"]["completion_tokens"] for event in running[:-1]]
    assert counts == sorted(counts) and counts[-1] == 4 and running[-1]["usage"] == last["usage"]
    assert all(e["usage"]["total_tokens"] == prompt + e["usage"]["completion_tokens"] for e in running[:-1])


SAMPLED: dict[str, Any] = {"n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 10}


async def test_n_completions_are_reproducible_choices(client: openai.AsyncOpenAI) -> None:
    first = await client.completions.create(model="tiny", prompt="Once upon", extra_body=NO_EOS, **SAMPLED)
    again = await client.completions.create(model="tiny", prompt="Once upon", extra_body=NO_EOS, **SAMPLED)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices], "a seed makes the choices reproducible"
    assert len(set(texts)) == 3, "choice i samples with seed + i"
    assert all(c.finish_reason == "length" for c in first.choices)
    assert first.usage is not None and first.usage.completion_tokens == 30  # the prompt counts once
    assert first.usage.total_tokens == first.usage.prompt_tokens + 30
    stream = await client.completions.create(
        model="tiny",
        prompt="Once upon",
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
        **SAMPLED,
    )
    chunks = [chunk async for chunk in stream]
    joined = {k: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == k) for k in range(3)}
    assert list(joined.values()) == texts
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason == "length"]
    assert sorted(finishes) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30


async def test_n_chat_completions_are_reproducible_choices(client: openai.AsyncOpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story"}]
    first = await client.chat.completions.create(model="tiny", messages=messages, extra_body=NO_EOS, **SAMPLED)
    again = await client.chat.completions.create(model="tiny", messages=messages, extra_body=NO_EOS, **SAMPLED)
    assert [c.index for c in first.choices] == [0, 1, 2]
    contents = [c.message.content for c in first.choices]
    assert contents == [c.message.content for c in again.choices] and len(set(contents)) == 3
    assert first.usage is not None and first.usage.completion_tokens == 30
    stream = await client.chat.completions.create(
        model="tiny", messages=messages, stream=True, extra_body=NO_EOS, **SAMPLED
    )
    chunks = [chunk async for chunk in stream]
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2]  # each choice opens with its role, as OpenAI's do
    joined = {k: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == k) for k in range(3)}
    assert list(joined.values()) == contents
    finishes = [c.choices[0].index for c in chunks if c.choices[0].finish_reason == "length"]
    assert sorted(finishes) == [0, 1, 2]


async def test_a_wrong_model_is_404_and_no_model_means_the_served_one(
    served: Served, client: openai.AsyncOpenAI
) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError) as chat_error:
        await client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=2, stream=True)
    with pytest.raises(openai.NotFoundError) as completion_error:
        await client.completions.create(model="tiny-but-not-quite", prompt="Hi", max_tokens=2)
    for error in (chat_error.value, completion_error.value):
        assert isinstance(error.body, dict)
        assert (error.body["code"], error.body["param"], error.body["type"]) == (
            "model_not_found",
            "model",
            "invalid_request_error",
        )
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        unnamed = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert unnamed.status_code == 200, unnamed.text
    assert unnamed.json()["model"] == str(served.model_dir)


async def test_chat_refusals_are_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="role"):  # Baton's check, passed on
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "wizard", "content": "x"}],  # type: ignore[list-item, misc]
            max_tokens=2,
        )
    with pytest.raises(openai.BadRequestError, match="messages"):
        await client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            stream_options={"include_usage": True},
        )


async def test_models(served: Served, client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [str(served.model_dir), ALIAS]
    assert all(m.owned_by == "baton" and m.model_dump()["root"] == str(served.model_dir) for m in models.data)
    assert (await client.models.retrieve(str(served.model_dir))).owned_by == "baton"
    assert (await client.models.retrieve(ALIAS)).id == ALIAS
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("something-else")
    assert isinstance(missing.value.body, dict) and missing.value.body["code"] == "model_not_found"


async def test_tokenize_and_detokenize_as_vllm_answers_them(served: Served) -> None:
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    text = "Where does the river run?"
    messages = [{"role": "user", "content": text}]
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        plain = (await http.post("/tokenize", json={"model": ALIAS, "prompt": text})).json()
        bare = (
            await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
        ).json()
        chat = (await http.post("/tokenize", json={"messages": messages})).json()
        open_turn = (await http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
        back = (await http.post("/detokenize", json={"model": ALIAS, "tokens": bare["tokens"]})).json()
        wrong_model = await http.post("/tokenize", json={"model": "other", "prompt": text})
        both = await http.post("/tokenize", json={"prompt": text, "messages": messages})
        unknown = await http.post("/tokenize", json={"messages": messages, "tools": [{"type": "function"}]})
        past = await http.post("/detokenize", json={"tokens": [8192]})
        not_ids = await http.post("/detokenize", json={"tokens": "abc"})
    assert plain == {
        "count": len(tokenizer(text).input_ids),
        "max_model_len": plain["max_model_len"],
        "tokens": tokenizer(text).input_ids,
        "token_strs": None,
    }
    assert plain["max_model_len"] > 0
    assert bare["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    assert chat["tokens"] == list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )
    assert open_turn["tokens"] == list(tokenizer.apply_chat_template(messages, return_dict=False))
    assert back == {"prompt": text}
    assert wrong_model.status_code == 404
    assert both.status_code == 400 and unknown.status_code == 400 and not_ids.status_code == 400
    assert past.status_code == 400 and "past the vocabulary" in past.json()["error"]["message"]


async def test_health(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        reply = await http.get("/health")
    assert reply.status_code == 200
    assert reply.json()["status"] == "SERVING"
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        version = await http.get("/version")
    assert version.status_code == 200 and version.json() == {"version": importlib.metadata.version("baton")}


async def test_bad_requests_are_400_with_openai_body(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=-1)
    assert "temperature" in bad.value.message
    assert isinstance(bad.value.body, dict) and bad.value.body["code"] == "invalid_argument"
    with pytest.raises(openai.BadRequestError):  # refused before the stream starts, so still a 400
        await client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=-1, stream=True)
    with pytest.raises(openai.BadRequestError, match="n must lie in"):  # Baton's bound (max_samples)
        await client.completions.create(model="tiny", prompt="Hello", n=129)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        await client.completions.create(model="tiny", prompt="Hello", n=2, best_of=3)
    with pytest.raises(openai.BadRequestError, match="priority"):
        await client.completions.create(model="tiny", prompt="Hello", extra_headers={"x-baton-priority": "high"})
    with pytest.raises(openai.BadRequestError, match="priority"):  # Baton's own bound
        await client.completions.create(model="tiny", prompt="Hello", extra_headers={"x-baton-priority": "11"})


async def test_malformed_json_and_unknown_route(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        bad = await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        # Bodies whose parsing or conversion raised: a 500 before, a 400 as any bad input.
        surrogate = await http.post("/v1/completions", content=b'{"prompt": "hi \\ud800", "max_tokens": 2}')
        nested = await http.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000)
        pair = await http.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude42", "max_tokens": 1}')
        missing = await http.get("/v1/nothing")
        wrong_method = await http.get("/v1/completions")
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    assert surrogate.status_code == 400 and "surrogate" in surrogate.json()["error"]["message"]
    assert nested.status_code == 400
    assert pair.status_code == 200  # an escaped surrogate pair is one character: fine
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


async def test_priority_and_tenant_headers_reach_baton(served: Served, client: openai.AsyncOpenAI) -> None:
    headers = {"x-baton-priority": "9", "x-baton-tenant": "acme"}
    out = await client.completions.create(
        model="tiny", prompt="Hi", max_tokens=3, user="ignored", extra_headers=headers
    )
    request_id = out.id.removeprefix("cmpl-")
    status = await served.stack.stub.GetRequest(pb.GetRequestRequest(request_id=request_id))
    assert status.state == pb.REQUEST_STATE_FINISHED
    assert status.tokens_generated == out.usage.completion_tokens  # type: ignore[union-attr]
    record = await _record(served, request_id)
    assert record["priority"] == "9"
    assert record["tenant"] == "acme"  # the header wins over the body's `user`

    out = await client.completions.create(model="tiny", prompt="Hi", max_tokens=3, user="bob")
    record = await _record(served, out.id.removeprefix("cmpl-"))
    assert record["tenant"] == "bob"
    assert record["priority"] == "5"  # Baton's default


async def test_request_id_header_is_idempotency_key(client: openai.AsyncOpenAI) -> None:
    headers = {"x-baton-request-id": "gateway-dup-1"}
    out = await client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_headers=headers)
    assert out.id == "cmpl-gateway-dup-1"
    with pytest.raises(openai.ConflictError):
        await client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_headers=headers)


async def test_the_baton_id_header_names_the_baton_request_when_the_body_labels_the_response(served: Served) -> None:
    """vLLM's body ``request_id`` names the response only; the header still names Baton's
    request, for GetRequest and Cancel (it carried the label, which names no request)."""
    body = {"model": ALIAS, "prompt": "Hi", "max_tokens": 2, "request_id": "label-xyz", **NO_EOS}
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        answer = await http.post("/v1/completions", json=body)
    baton_id = answer.headers["x-baton-request-id"]
    assert answer.json()["id"] == "cmpl-label-xyz" and baton_id != "label-xyz"
    status = await served.stack.stub.GetRequest(pb.GetRequestRequest(request_id=baton_id))
    assert status.state == pb.REQUEST_STATE_FINISHED and status.tokens_generated == 2


async def _wait_state(served: Served, request_id: str, state: int, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while True:
            status = await served.stack.stub.GetRequest(pb.GetRequestRequest(request_id=request_id))
            if status.state == state:
                return
            await asyncio.sleep(0.05)


async def test_client_disconnect_cancels_the_baton_request(served: Served, client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model="tiny", prompt="Hello", max_tokens=3000, stream=True, temperature=0, extra_body=NO_EOS
    )
    seen = []
    async for chunk in stream:
        seen.append(chunk)
        if len(seen) >= 2:
            break
    await stream.close()
    await _wait_state(served, seen[0].id.removeprefix("cmpl-"), pb.REQUEST_STATE_CANCELLED)


async def test_every_response_carries_an_x_request_id(served: Served) -> None:
    """The client's own X-Request-Id comes back (a proxy's trace id), as vLLM's server echoes it;
    without one, the id Baton gave the request; an answer with neither, a new one. Baton's own id
    stays its own: the same header twice is never a duplicate request."""
    body = {"model": ALIAS, "prompt": "Hi", "max_tokens": 2, **NO_EOS}
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        traced = [await http.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-7"}) for _ in range(2)]
        plain = await http.post("/v1/completions", json=body)
        health = await http.get("/health")
        odd = await http.post("/v1/completions", json=body, headers={"X-Request-Id": "has space"})
    assert [r.status_code for r in traced] == [200, 200] and [r.headers["x-request-id"] for r in traced] == [
        "trace-7"
    ] * 2
    assert traced[0].headers["x-baton-request-id"] != traced[1].headers["x-baton-request-id"]
    assert plain.headers["x-request-id"] == plain.headers["x-baton-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", health.headers["x-request-id"])
    assert odd.headers["x-request-id"] == odd.headers["x-baton-request-id"]  # not a header value to echo


async def test_unreachable_target_is_503() -> None:
    app = create_app(f"127.0.0.1:{free_port()}")
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            health = await http.get("/health")
            completion = await http.post("/v1/completions", json={"model": "t", "prompt": "Hi"})
    finally:
        await app.state.gateway.close()
    assert health.status_code == 503 and health.json()["status"] == "UNREACHABLE"
    assert completion.status_code == 503
    assert completion.json()["error"]["code"] == "unavailable"


def test_cli_has_gateway_subcommand() -> None:
    from gateway import server

    args = build_parser().parse_args(["gateway", "--port", "8123", "--target", "sched:50051"])
    assert (args.port, args.target, args.host) == (8123, "sched:50051", "0.0.0.0")
    assert args.func is server.run
    for parser in TOOL_CALL_PARSERS:  # the flag offers every syntax the gateway reads
        assert build_parser().parse_args(["gateway", "--tool-call-parser", parser]).tool_call_parser == parser
    for parser in REASONING_PARSERS:
        assert build_parser().parse_args(["gateway", "--reasoning-parser", parser]).reasoning_parser == parser


def test_gpt_oss_s_tool_call_parser_needs_its_reasoning_parser() -> None:
    """The openai parser reads the calls the openai_gptoss split leaves in the answer: alone, it would
    read raw harmony, so the gateway refuses to start so."""
    with pytest.raises(ValueError, match="needs the openai_gptoss reasoning parser"):
        create_app(f"127.0.0.1:{free_port()}", tool_call_parser="openai")


# ---- sampling controls and log probabilities ---------------------------------------------------


async def test_completion_logprobs_are_batons(served: Served, client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(
        model=ALIAS, prompt="Once upon", max_tokens=6, temperature=0, logprobs=3, extra_body=NO_EOS
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    grpc_params = pb.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    baton = await served.stack.stub.Complete(pb.GenerateRequest(prompt="Once upon", params=grpc_params))
    assert logprobs.tokens == [p.token.text for p in baton.logprobs]
    assert logprobs.token_logprobs == pytest.approx([p.token.logprob for p in baton.logprobs], abs=1e-6)
    for top, position in zip(logprobs.top_logprobs, baton.logprobs, strict=True):
        assert top == pytest.approx({alt.text: alt.logprob for alt in position.top}, abs=1e-6)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert "".join(logprobs.tokens) == out.choices[0].text


async def test_echo_scores_a_prompt_as_lm_eval_asks(served: Served, client: openai.AsyncOpenAI) -> None:
    """lm-eval's loglikelihood: token ids, echo, logprobs=1, max_tokens=1; it reads the prompt's
    token_logprobs and checks the continuation is greedy against top_logprobs."""
    context = list((await served.stack.stub.Tokenize(pb.TokenizeRequest(text="The river"))).token_ids)
    greedy = await client.completions.create(
        model=ALIAS, prompt=context, max_tokens=3, temperature=0, extra_body=NO_EOS
    )
    ids = list(
        (await served.stack.stub.Tokenize(pb.TokenizeRequest(text="The river" + greedy.choices[0].text))).token_ids
    )
    prompt = context + ids[len(context) :]
    out = await client.completions.create(
        model=ALIAS, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == len(prompt) + 1 and logprobs.token_logprobs[0] is None
    expected = model_logprobs(load_reference_model(served.model_dir), prompt)
    want = [float(expected[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(want, abs=1e-4)
    continuation = slice(len(context), -1)
    scored = zip(logprobs.token_logprobs[continuation], logprobs.top_logprobs[continuation], strict=True)
    assert all(lp == max(top.values()) for lp, top in scored)  # lm-eval's is_greedy
    assert out.choices[0].text.startswith("".join(logprobs.tokens[: len(prompt)]))

    # OpenAI's legacy max_tokens=0: the prompt alone, scored.
    only = await client.completions.create(model=ALIAS, prompt="The river", echo=True, logprobs=0, max_tokens=0)
    assert only.choices[0].text == "The river" and only.choices[0].finish_reason == "length"
    assert only.usage is not None and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs is not None and only.choices[0].logprobs.token_logprobs is not None
    assert len(only.choices[0].logprobs.token_logprobs) == len(context)


async def test_prompt_logprobs_in_vllms_shape(served: Served) -> None:
    """vLLM's prompt_logprobs: null, then per position the prompt's token with its rank and the
    most likely tokens ranked 1..k, keyed by token id; each completion choice's, a chat's at the
    top. An echo beside them keeps its own count of alternatives."""
    prompt = list((await served.stack.stub.Tokenize(pb.TokenizeRequest(text="The river bank"))).token_ids)
    expected = model_logprobs(load_reference_model(served.model_dir), prompt)
    body = {"model": ALIAS, "prompt": prompt, "max_tokens": 2, "n": 2, "temperature": 0, "prompt_logprobs": 3}
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        completion = (await http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1})).json()
        messages = [{"role": "user", "content": "Hi"}]
        chat_body = {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
        chat = (await http.post("/v1/chat/completions", json=chat_body)).json()
        streamed = await http.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.json()["error"]["message"]
    first, second = (choice["prompt_logprobs"] for choice in completion["choices"])
    assert first == second and len(first) == len(prompt) and first[0] is None
    for q, position in enumerate(first[1:], start=1):
        row, token = expected[q - 1], prompt[q]
        entries = list(position.items())
        assert entries[0][0] == str(token) and len(position) in (3, 4)  # the token, and the top 3 it may be among
        value, rank = float(row[token]), entries[0][1]["rank"]
        assert entries[0][1]["logprob"] == pytest.approx(value, abs=1e-4)
        # How many tokens are at least as likely (those within the tolerance may fall either side).
        assert int((row > value + 1e-4).sum()) + 1 <= rank <= int((row >= value - 1e-4).sum())
        alternatives = sorted((e for e in position.values() if e["rank"] <= 3), key=lambda e: e["rank"])
        assert [e["logprob"] for e in alternatives] == pytest.approx(torch.topk(row, 3).values.tolist(), abs=1e-4)
        assert all(isinstance(e["decoded_token"], str) for e in position.values())
    # The echo's own alternatives: logprobs=1 (and the prompt's token), not prompt_logprobs' 3.
    echo_top = completion["choices"][0]["logprobs"]["top_logprobs"]
    assert echo_top[0] is None and all(len(top) <= 2 for top in echo_top[1 : len(prompt)])
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(p) == 1 and next(iter(p.values()))["rank"] >= 1 for p in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in chat["choices"][0]


async def test_a_prompt_of_token_ids_is_echoed_as_its_tokens_decode_together(
    served: Served, client: openai.AsyncOpenAI
) -> None:
    """Joining each token's own text split the characters a byte-level tokenizer spreads over
    several tokens (U+FFFD each); vLLM echoes ``tokenizer.decode(ids)``."""
    text = "naïve café 日本語"
    ids = list((await served.stack.stub.Tokenize(pb.TokenizeRequest(text=text))).token_ids)
    expected = AutoTokenizer.from_pretrained(served.model_dir).decode(ids, skip_special_tokens=False)
    assert "日本語" in expected
    whole = await client.completions.create(model=ALIAS, prompt=ids, echo=True, max_tokens=0)
    assert whole.choices[0].text == expected
    stream = await client.completions.create(model=ALIAS, prompt=ids, echo=True, max_tokens=2, stream=True)
    echoed = "".join([c.choices[0].text async for c in stream])
    assert echoed.startswith(expected)


async def test_completion_stream_logprobs_join_to_whole(client: openai.AsyncOpenAI) -> None:
    kwargs: dict[str, Any] = {"model": ALIAS, "prompt": "abc", "max_tokens": 8, "temperature": 0, "extra_body": NO_EOS}
    whole = await client.completions.create(logprobs=2, echo=True, **kwargs)
    stream = await client.completions.create(logprobs=2, echo=True, stream=True, **kwargs)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.choices[0].text.startswith("abc")
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        part = chunk.choices[0].logprobs
        if part is not None:
            for key, values in joined.items():
                values.extend(getattr(part, key) or [])
    assert whole.choices[0].logprobs is not None
    assert joined["tokens"] == whole.choices[0].logprobs.tokens
    assert joined["token_logprobs"] == whole.choices[0].logprobs.token_logprobs
    assert joined["text_offset"] == whole.choices[0].logprobs.text_offset


async def test_chat_logprobs_whole_and_streamed(client: openai.AsyncOpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    kwargs: dict[str, Any] = {"model": ALIAS, "messages": messages, "max_tokens": 6, "temperature": 0}
    whole = await client.chat.completions.create(logprobs=True, top_logprobs=2, extra_body=NO_EOS, **kwargs)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    assert all(e.logprob == max(e.logprob, *(t.logprob for t in e.top_logprobs)) for e in content)  # greedy
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    stream = await client.chat.completions.create(
        logprobs=True, top_logprobs=2, stream=True, extra_body=NO_EOS, **kwargs
    )
    streamed = [
        e
        for c in [c async for c in stream]
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = await client.chat.completions.create(extra_body=NO_EOS, **kwargs)
    assert plain.choices[0].logprobs is None


async def test_penalties_and_vllm_extensions_reach_baton(served: Served, client: openai.AsyncOpenAI) -> None:
    body = {"repetition_penalty": 1.3, "min_tokens": 4, "min_p": 0.1, **NO_EOS}
    out = await client.completions.create(
        model=ALIAS,
        prompt="abc abc abc",
        max_tokens=12,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=1.0,
        logit_bias={"42": 3},
        extra_body=body,
    )
    params = pb.SamplingParams(
        max_tokens=12,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=1.0,
        logit_bias={42: 3.0},
        repetition_penalty=1.3,
        min_tokens=4,
        min_p=0.1,
    )
    baton = await served.stack.stub.Complete(pb.GenerateRequest(prompt="abc abc abc", params=params))
    plain = await client.completions.create(
        model=ALIAS, prompt="abc abc abc", max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    assert out.choices[0].text == baton.text != plain.choices[0].text

    text = plain.choices[0].text
    stop = text[len(text) // 2 :][:2]
    if len(stop) == 2 and text.index(stop) > 0:
        kept = await client.completions.create(
            model=ALIAS,
            prompt="abc abc abc",
            max_tokens=12,
            temperature=0,
            stop=stop,
            extra_body={"include_stop_str_in_output": True, **NO_EOS},
        )
        assert kept.choices[0].text == text[: text.index(stop) + 2]


async def test_vocabulary_controls_and_truncation_reach_baton(served: Served, client: openai.AsyncOpenAI) -> None:
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    eos = tokenizer.eos_token_id
    forced = {"allowed_token_ids": [eos], "skip_special_tokens": False, **NO_EOS}
    out = await client.completions.create(model=ALIAS, prompt="abc", max_tokens=2, temperature=0, extra_body=forced)
    assert out.choices[0].text == tokenizer.eos_token * 2

    plain = await client.completions.create(
        model=ALIAS, prompt="abc abc", max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    word = plain.choices[0].text.split()[0] if plain.choices[0].text.split() else ""
    if word:
        banned = await client.completions.create(
            model=ALIAS, prompt="abc abc", max_tokens=8, temperature=0, extra_body={"bad_words": [word], **NO_EOS}
        )
        params = pb.SamplingParams(max_tokens=8, ignore_eos=True, bad_words=[word])
        baton = await served.stack.stub.Complete(pb.GenerateRequest(prompt="abc abc", params=params))
        assert banned.choices[0].text == baton.text  # what the words ban is the scheduler's test

    prompt = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(prompt)
    echoed = await client.completions.create(
        model=ALIAS, prompt=prompt, max_tokens=0, echo=True, extra_body={"truncate_prompt_tokens": 4}
    )
    assert echoed.choices[0].text == tokenizer.decode(ids[-4:]) and echoed.usage is not None
    assert echoed.usage.prompt_tokens == 4

    named = await client.completions.create(
        model=ALIAS,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, **NO_EOS},
    )
    params = pb.SamplingParams(max_tokens=4, ignore_eos=True)
    baton = await served.stack.stub.Complete(pb.GenerateRequest(prompt=prompt, params=params))
    assert named.choices[0].logprobs is not None
    assert named.choices[0].logprobs.tokens == [f"token_id:{t}" for t in baton.token_ids]
    bare = await client.completions.create(
        model=ALIAS, prompt=prompt, max_tokens=1, extra_body={"add_special_tokens": False}
    )
    assert bare.usage is not None and bare.usage.prompt_tokens == len(ids) - 1  # no BOS


async def test_bad_sampling_fields_are_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        await client.completions.create(model=ALIAS, prompt="Hi", logprobs=21)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):  # Baton's own bound
        await client.completions.create(model=ALIAS, prompt="Hi", presence_penalty=2.5)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):  # outside the vocabulary
        await client.completions.create(model=ALIAS, prompt="Hi", logit_bias={"99999999": 1})
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        await client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Hi"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # 0 only with echo
        await client.completions.create(model=ALIAS, prompt="Hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):  # outside the vocabulary
        await client.completions.create(model=ALIAS, prompt="Hi", extra_body={"allowed_token_ids": [99999999]})
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        await client.completions.create(model=ALIAS, prompt="Hi", extra_body={"truncate_prompt_tokens": 0})


async def test_n_choices_each_carry_their_own_logprobs(client: openai.AsyncOpenAI) -> None:
    kwargs: dict[str, Any] = {"model": ALIAS, "prompt": "Once upon", "max_tokens": 5, "logprobs": 2, "n": 2}
    out = await client.completions.create(temperature=1.0, seed=3, extra_body=NO_EOS, **kwargs)
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert "".join(choice.logprobs.tokens) == choice.text and len(choice.logprobs.tokens) == 5
    stream = await client.completions.create(temperature=1.0, seed=3, extra_body=NO_EOS, stream=True, **kwargs)
    tokens: dict[int, list[str]] = {0: [], 1: []}
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.tokens:
                tokens[choice.index] += choice.logprobs.tokens
    for choice in out.choices:  # the same seeds: the same samples, whole or streamed
        assert tokens[choice.index] == choice.logprobs.tokens  # type: ignore[union-attr]


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "weather", "description": "A city's weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "clock"}},
]


async def _streamed_calls(stream: Any) -> tuple[dict[int, dict[str, str]], str | None]:
    """Each streamed call's id, name and joined arguments, by index, and the finish reason."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    return calls, finish


async def test_tool_calls_forced_streamed_and_answered(served: Served, client: openai.AsyncOpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "The weather in Oslo?"}]
    named: Any = {"type": "function", "function": {"name": "weather"}}
    ask: dict[str, Any] = {"model": ALIAS, "messages": messages, "tools": TOOLS, "max_tokens": 100, "temperature": 0}
    whole = await client.chat.completions.create(**ask, tool_choice=named)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)

    calls, finish = await _streamed_calls(await client.chat.completions.create(**ask, tool_choice=named, stream=True))
    assert finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "weather" and calls[0]["arguments"] == call.function.arguments and calls[0]["id"]

    required = await client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.tool_calls
    (only,) = required.choices[0].message.tool_calls
    assert only.function.name in ("weather", "clock") and isinstance(json.loads(only.function.arguments), dict)
    calls, finish = await _streamed_calls(
        await client.chat.completions.create(**ask, tool_choice="required", stream=True)
    )
    assert finish == "tool_calls" and calls and all(c["name"] in ("weather", "clock") for c in calls.values())

    with pytest.raises(openai.BadRequestError, match="tool_choice"):  # "auto" needs a parser Baton lacks
        await client.chat.completions.create(**ask)

    # The next turn: the call and its result go to the template with the tools.
    follow: list[Any] = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = await client.chat.completions.create(
        model=ALIAS, messages=follow, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0, extra_body=NO_EOS
    )
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"
    rendered: list[Any] = [
        *messages,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "weather", "arguments": json.loads(call.function.arguments)},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": call.id},
    ]
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    ids = tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)


def _written(question: str, regex: str) -> dict[str, Any]:
    """A chat body with the tools whose output ``regex`` fixes (structured output, which a tool
    choice of "auto" allows beside it): the generated model writes no calls or thinking of itself."""
    return {
        "model": ALIAS,
        "messages": [{"role": "user", "content": question}],
        "tools": TOOLS,
        "max_tokens": 100,
        "temperature": 0,
        "structured_outputs": {"regex": regex},
    }


async def test_auto_tool_choice_reads_the_calls_the_model_writes(served: Served) -> None:
    """A call written in the Hermes syntax, which the gateway's parser turns into tool_calls."""
    written = r'On it\. <tool_call>\{"name": "weather", "arguments": \{"city": "Oslo"\}\}</tool_call>'
    ask = _written("The weather in Oslo?", written)
    ask["extra_body"] = {"structured_outputs": ask.pop("structured_outputs")}
    async with (
        serve_gateway(served.stack.target, model_aliases=(ALIAS,), tool_call_parser="hermes") as base_url,
        openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client,
    ):
        whole = await client.chat.completions.create(**ask)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "On it. "
        assert choice.message.tool_calls is not None
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            ("weather", '{"city": "Oslo"}')
        ]
        calls, finish = await _streamed_calls(await client.chat.completions.create(**ask, stream=True))
        assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls.values()] == [
            ("weather", '{"city": "Oslo"}')
        ]
        text = await client.chat.completions.create(**{**ask, "extra_body": NO_EOS, "max_tokens": 6})
        assert text.choices[0].message.tool_calls is None and text.choices[0].finish_reason == "length"


async def test_a_reasoning_parser_splits_thinking_from_the_answer(served: Served) -> None:
    """The model thinks in tags, then answers, then calls a tool. A structured output constrains
    the answer, after ``</think>``: the regex writes the tags here only because the prompt already
    closed the thinking (``enable_thinking: false``), which holds the constraint from the start.
    ``glm45`` reads the output itself (``qwen3`` would take the switch as all answer)."""
    written = r'<think>Two and two\.</think>It is 4\.<tool_call>\{"name": "clock", "arguments": \{\}\}</tool_call>'
    ask = {**_written("2 + 2?", written), "chat_template_kwargs": {"enable_thinking": False}}
    gateway = serve_gateway(
        served.stack.target, model_aliases=(ALIAS,), tool_call_parser="hermes", reasoning_parser="glm45"
    )
    async with gateway as base_url, httpx.AsyncClient(base_url=base_url) as http:
        whole = (await http.post("/v1/chat/completions", json=ask)).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] == message["reasoning"] == "Two and two."
        assert message["content"] == "It is 4." and whole["choices"][0]["finish_reason"] == "tool_calls"
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["clock"]

        events = await _sse_events(http, "/v1/chat/completions", {**ask, "stream": True})
        deltas = [event["choices"][0]["delta"] for event in events if event["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two."
        assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["clock"]

        # Thinking on, the constraint waits for a </think> this model never writes: free text.
        thinking = {**ask, "tools": None, "max_tokens": 6, **NO_EOS}
        del thinking["chat_template_kwargs"]
        answer = (await http.post("/v1/chat/completions", json=thinking)).json()["choices"][0]
        assert answer["finish_reason"] == "length" and answer["message"]["content"]
        assert answer["message"]["reasoning_content"] is None  # glm45: no opening tag, all answer


async def test_template_variables_switch_the_thinking_the_parser_reads(served: Served) -> None:
    """DeepSeek V3.1 thinks only where the request's template variables say so: without them its
    output is all answer, with them (as R1's) all thinking until a ``</think>`` it never writes here."""
    ask = {"model": ALIAS, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, **NO_EOS}
    gateway = serve_gateway(served.stack.target, model_aliases=(ALIAS,), reasoning_parser="deepseek_v3")
    async with gateway as base_url, httpx.AsyncClient(base_url=base_url) as http:
        plain = (await http.post("/v1/chat/completions", json=ask)).json()["choices"][0]["message"]
        thinking = {**ask, "chat_template_kwargs": {"thinking": True}}
        thought = (await http.post("/v1/chat/completions", json=thinking)).json()["choices"][0]["message"]
    assert plain["content"] and plain["reasoning_content"] is None
    assert thought["content"] is None and thought["reasoning_content"]


async def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(served: Served) -> None:
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    body: dict[str, Any] = {"model": ALIAS, "max_tokens": 5, "temperature": 0, "return_token_ids": True, **NO_EOS}
    messages = [{"role": "user", "content": "Hi"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        whole = (await http.post("/v1/completions", json={**body, "prompt": "The river"})).json()
        (choice,) = whole["choices"]
        assert choice["prompt_token_ids"] == tokenizer("The river").input_ids and len(choice["token_ids"]) == 5
        assert tokenizer.decode(choice["token_ids"]) == choice["text"]
        events = await _sse_events(http, "/v1/completions", {**body, "prompt": "The river", "stream": True})
        streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
        assert streamed == choice["token_ids"]
        assert [c["prompt_token_ids"] for e in events for c in e["choices"] if "prompt_token_ids" in c] == [
            choice["prompt_token_ids"]
        ]
        chat = (await http.post("/v1/chat/completions", json={**body, "messages": messages})).json()
        assert chat["prompt_token_ids"] == chat_ids and len(chat["choices"][0]["token_ids"]) == 5
        events = await _sse_events(http, "/v1/chat/completions", {**body, "messages": messages, "stream": True})
        assert [e["prompt_token_ids"] for e in events if "prompt_token_ids" in e] == [chat_ids]
        assert [t for e in events for c in e["choices"] for t in c.get("token_ids", [])] == chat["choices"][0][
            "token_ids"
        ]
        plain = (
            await http.post("/v1/completions", json={**body, "prompt": "The river", "return_token_ids": False})
        ).json()
        assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


@pytest.mark.parametrize(
    ("parser", "written", "content", "id_pattern"),
    [
        ("llama3_json", r'\{"name": "clock", "parameters": \{\}\}', None, r"call_[0-9a-f]{24}"),
        ("mistral", r"Checking\. \[TOOL_CALLS\]clock\[ARGS\]\{\}", "Checking. ", r"[A-Za-z0-9]{9}"),
        ("pythonic", r"\[clock\(\)\]", None, r"call_[0-9a-f]{24}"),
        ("qwen3_coder", r"<tool_call>\n<function=clock>\n</function>\n</tool_call>", None, r"call_[0-9a-f]{24}"),
        ("glm45", r"<tool_call>clock\n</tool_call>", None, r"call_[0-9a-f]{24}"),
        ("granite", r'<\|tool_call\|>\[\{"name": "clock", "arguments": \{\}\}\]', None, r"call_[0-9a-f]{24}"),
        (
            "deepseek_v31",
            "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>clock"
            "<\uff5ctool\u2581sep\uff5c>\\{\\}<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>",
            None,
            r"call_[0-9a-f]{24}",
        ),
        (
            "kimi_k2",
            r"Checking\. <\|tool_calls_section_begin\|><\|tool_call_begin\|>functions\.clock:0"
            r"<\|tool_call_argument_begin\|>\{\}<\|tool_call_end\|><\|tool_calls_section_end\|>",
            "Checking. ",
            r"functions\.clock:0",
        ),
    ],
)
async def test_auto_tool_choice_reads_each_syntax(
    served: Served, parser: str, written: str, content: str | None, id_pattern: str
) -> None:
    """The same in the other syntaxes, whole and streamed, with the ids each family's template takes
    back (Mistral's: nine letters and digits; Kimi's: the one the model wrote)."""
    ask = _written("What time is it?", written)
    gateway = serve_gateway(served.stack.target, model_aliases=(ALIAS,), tool_call_parser=parser)
    async with gateway as base_url, httpx.AsyncClient(base_url=base_url) as http:
        whole = (await http.post("/v1/chat/completions", json=ask)).json()["choices"][0]
        assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == content
        calls = whole["message"]["tool_calls"]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("clock", "{}")]
        assert re.fullmatch(id_pattern, calls[0]["id"])
        events = await _sse_events(http, "/v1/chat/completions", {**ask, "stream": True})
        deltas = [event["choices"][0]["delta"] for event in events if event["choices"]]
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["function"]["name"] for c in streamed] == ["clock"] and re.fullmatch(id_pattern, streamed[0]["id"])
        assert "".join(d.get("content") or "" for d in deltas) == (content or "")


# ---- the Responses API -------------------------------------------------------------------------


async def test_the_responses_api_answers_as_the_chat_route(client: openai.AsyncOpenAI) -> None:
    """A Responses request is served as the chat request it amounts to, whole and streamed, through
    OpenAI's own client."""
    ask: dict[str, Any] = {"model": ALIAS, "temperature": 0, "max_output_tokens": 6, "extra_body": NO_EOS}
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    chat = await client.chat.completions.create(
        model=ALIAS, messages=messages, temperature=0, max_tokens=6, extra_body=NO_EOS
    )
    whole = await client.responses.create(instructions="Be brief.", input="Hi", **ask)
    assert whole.output_text == chat.choices[0].message.content and whole.status == "incomplete"
    assert whole.incomplete_details is not None and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 6
    assert chat.usage is not None and whole.usage.input_tokens == chat.usage.prompt_tokens
    stream = await client.responses.create(instructions="Be brief.", input="Hi", stream=True, **ask)
    events = [event async for event in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(input="Hi", **{**ask, "max_output_tokens": 10**6})
    assert "max_output_tokens (1000000)" in str(refused.value) and "max_tokens" not in str(refused.value)


async def test_the_responses_api_calls_tools(served: Served) -> None:
    """A function call the model writes comes back as a function_call item, and its output goes
    back to the model as the chat route's tool message."""
    written = r'<tool_call>\{"name": "clock", "arguments": \{\}\}</tool_call>'
    tools = [{"type": "function", "name": "clock", "parameters": {"type": "object", "properties": {}}}]
    body: dict[str, Any] = {"model": ALIAS, "input": "Time?", "tools": tools, "max_output_tokens": 60, "temperature": 0}
    gateway = serve_gateway(served.stack.target, model_aliases=(ALIAS,), tool_call_parser="hermes")
    async with gateway as base_url, openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as ai:
        called = await ai.responses.create(**body, extra_body={"structured_outputs": {"regex": written}})
        (call,) = called.output
        assert call.type == "function_call" and call.name == "clock" and call.arguments == "{}"
        follow_up = [
            {"role": "user", "content": "Time?"},
            {"type": "function_call", "call_id": call.call_id, "name": "clock", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call.call_id, "output": "noon"},
        ]
        answer = await ai.responses.create(**{**body, "input": follow_up, "max_output_tokens": 3})
        assert answer.output[0].type == "message" and answer.usage is not None and called.usage is not None
        assert answer.usage.input_tokens > called.usage.input_tokens  # the call and its result went back


# ---- Anthropic's Messages API -------------------------------------------------------------------


async def test_the_messages_api_answers_as_the_chat_route(served: Served, client: openai.AsyncOpenAI) -> None:
    """Anthropic's Messages API, whole and streamed as its events, says what the chat route says."""
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    chat = await client.chat.completions.create(
        model=ALIAS, messages=messages, temperature=0, max_tokens=6, extra_body=NO_EOS
    )
    body = {"model": ALIAS, "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
    body |= {"temperature": 0, **NO_EOS}
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        whole = (await http.post("/v1/messages", json=body)).json()
        assert whole["content"] == [{"type": "text", "text": chat.choices[0].message.content}]
        assert whole["stop_reason"] == "max_tokens" and whole["usage"]["output_tokens"] == 6
        async with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as reply:
            lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
        events = [json.loads(line.removeprefix("data: ")) for line in lines]
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        assert text == whole["content"][0]["text"] and events[-2]["delta"]["stop_reason"] == "max_tokens"
        refused = await http.post("/v1/messages", json={k: v for k, v in body.items() if k != "max_tokens"})
        counted = (
            await http.post("/v1/messages/count_tokens", json={k: body[k] for k in ("model", "system", "messages")})
        ).json()
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
    # count_tokens counts the prompt the request had: the tokens it read from the cache and the rest.
    assert counted == {"input_tokens": whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"]}
