"""The served model's generation_config fills what an OpenAI request leaves out, as in vLLM's server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from common.pb import generate_pb2 as pb
from gateway.openai_types import apply_model_defaults, parse_chat, parse_completion
from tests.gateway.serving import serve_gateway
from tests.stack import stack_config, start_stack

# What a chat model's generation_config.json often recommends, here with greedy decoding so the
# effect is exact: temperature 0 (not transformers' 1.0), top_k 7 (not 50), max_new_tokens 3.
RECOMMENDED = {"temperature": 0.0, "top_k": 7, "max_new_tokens": 3}


def test_defaults_fill_only_what_the_body_leaves_out() -> None:
    defaults = pb.SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_tokens=100)
    left_out = parse_chat({"messages": [{"role": "user", "content": "Hi"}]}).request.params
    apply_model_defaults(left_out, {}, defaults)
    assert left_out.temperature == pytest.approx(0.6) and left_out.top_p == pytest.approx(0.9)
    assert left_out.top_k == 20
    # Chat's default is the context's room, which the scheduler caps by max_new_tokens, knowing the prompt.
    assert not left_out.HasField("max_tokens") and left_out.fill_context
    assert left_out.repetition_penalty == pytest.approx(1.1) and left_out.min_p == 0
    body = {"prompt": "a", "temperature": 1.0, "top_k": 0, "max_tokens": 500, "repetition_penalty": 1.0}
    asked = parse_completion(body).request.params
    apply_model_defaults(asked, body, defaults)
    assert (asked.temperature, asked.top_k, asked.repetition_penalty) == (1.0, 0, 1.0)
    assert asked.top_p == pytest.approx(0.9)
    assert asked.max_tokens == 500  # max_new_tokens caps only what a request leaves unset, as in vLLM
    plain = parse_completion({"prompt": "a"}).request.params
    apply_model_defaults(plain, {}, pb.SamplingDefaults())  # a model that recommends nothing
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 16)  # OpenAI's own defaults


async def test_the_gateway_applies_the_model_generation_config(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "tuned"
    shutil.copytree(tiny_model_dir, model_dir)
    config_path = model_dir / "generation_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **RECOMMENDED}))
    stack = await start_stack(stack_config(redis_url, model_dir))
    try:
        info = await stack.stub.ModelInfo(pb.ModelInfoRequest())
        assert info.sampling_defaults == pb.SamplingDefaults(temperature=0.0, top_k=7, max_tokens=3)
        async with serve_gateway(stack.target) as base_url:
            client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
            async with client:
                extra = {"ignore_eos": True}
                hello: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
                left_out = await client.chat.completions.create(model="", messages=hello, extra_body=extra)
                greedy = await client.chat.completions.create(
                    model="", messages=hello, temperature=0, max_tokens=3, extra_body=extra
                )
                asked = await client.completions.create(model="", prompt="Hello", max_tokens=20, extra_body=extra)
                completion = await client.completions.create(model="", prompt="Hello", extra_body=extra)
        # Chat's default (the context's room) capped by max_new_tokens, not Baton's default of 256.
        assert left_out.usage is not None and left_out.usage.completion_tokens == 3
        assert left_out.choices[0].message.content == greedy.choices[0].message.content  # temperature 0
        assert asked.usage is not None and asked.usage.completion_tokens == 20  # asked for: not capped
        assert completion.usage is not None and completion.usage.completion_tokens == 16  # OpenAI's default
    finally:
        await stack.stop()
