"""Structured output end to end through gRPC: real redis-server, real executor and scheduler
servers, the tiny model (random weights: free text is gibberish, so only the grammar gives form)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from common.pb import generate_pb2 as pb
from tests.conftest import RedisServer
from tests.scheduler_service.test_end_to_end import _first_chunks, random_prompts
from tests.stack import Stack, joined_tokens, stack_config, start_stack

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "ok"],
    "additionalProperties": False,
}
LONG_REGEX = r"[a-z]{4}( [a-z]{2,6}){40,50}\."


@pytest.fixture(scope="module")
async def stack(redis_server: RedisServer, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    # One request runs at a time, and a priority gap of 3 preempts (for the preemption test).
    redis_server.flush()
    scheduler = {"batch_level": {"max_batch_size": 1}, "request_level": {"preempt_priority_gap": 3}}
    running = await start_stack(stack_config(redis_server.url, tiny_model_dir, scheduler=scheduler))
    yield running
    await running.stop()


def request(prompt: list[int], structured: pb.StructuredOutput, **fields: Any) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=300, ignore_eos=True, structured_output=structured)
    return pb.GenerateRequest(prompt_token_ids=prompt, params=params, **fields)


async def test_json_schema_output_parses_and_validates(stack: Stack) -> None:
    for i, prompt in enumerate(random_prompts(3, seed=61)):
        whole = await stack.stub.Complete(request(prompt, pb.StructuredOutput(json_schema=json.dumps(SCHEMA))))
        assert whole.finish_reason == pb.FINISH_REASON_STOP, i
        jsonschema.validate(json.loads(whole.text), SCHEMA)


async def test_streamed_regex_choice_and_grammar_outputs(stack: Stack) -> None:
    prompt = random_prompts(1, seed=62)[0]
    chunks = await stack.generate(request(prompt, pb.StructuredOutput(regex=r"\d{3}-[a-z]{2,5}")))
    assert re.fullmatch(r"\d{3}-[a-z]{2,5}", "".join(c.text for c in chunks))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
    choices = ["alpha", "beta gamma", "δ"]
    whole = await stack.stub.Complete(request(prompt, pb.StructuredOutput(choice=pb.StructuredChoice(choices=choices))))
    assert whole.text in choices
    grammar = 'root ::= "[" item ("," item){0,2} "]"\nitem ::= [a-c]'
    whole = await stack.stub.Complete(request(prompt, pb.StructuredOutput(grammar=grammar)))
    assert re.fullmatch(r"\[[a-c](,[a-c]){0,2}\]", whole.text)
    # Any object may hold endless strings; on this prompt the tiny model closes its object.
    whole = await stack.stub.Complete(request([1, 5, 6], pb.StructuredOutput(json_object=True)))
    assert whole.finish_reason == pb.FINISH_REASON_STOP and isinstance(json.loads(whole.text), dict)


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        (pb.StructuredOutput(json_schema='{"type": "object", "properties": 5}'), "structured_output json_schema: "),
        (pb.StructuredOutput(json_schema="{oops"), "Failed to parse JSON"),
        (pb.StructuredOutput(regex="[a-"), "structured_output regex: "),
        (pb.StructuredOutput(grammar='root ::= "a" | '), "structured_output grammar: "),
        (pb.StructuredOutput(choice=pb.StructuredChoice()), "at least one choice"),
    ],
)
async def test_invalid_constraints_are_invalid_arguments(
    stack: Stack, structured: pb.StructuredOutput, message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.Complete(request([1, 5, 6], structured))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or ""), err.value.details()


async def test_min_tokens_with_a_constraint_is_served_and_a_schema_it_could_not_enforce_refused(stack: Stack) -> None:
    msg = request([1, 5, 6], pb.StructuredOutput(regex="[0-9]{3}[a-z]*"))
    msg.params.min_tokens, msg.params.max_tokens = 3, 6  # as vLLM serves it: no end before 3 tokens
    whole = await stack.stub.Complete(msg)
    assert whole.finish_reason == pb.FINISH_REASON_LENGTH and len(whole.token_ids) == 6
    assert re.fullmatch("[0-9]{3}[a-z]*", whole.text)
    unique = pb.StructuredOutput(json_schema=json.dumps({"type": "array", "uniqueItems": True}))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.Complete(request([1, 5, 6], unique))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "could not enforce" in str(err.value.details())


async def test_preempted_request_continues_its_constraint(stack: Stack) -> None:
    """Preempted for a more important request, it resumes from the tokens Redis recorded, and its
    grammar from them: the output is the one it would have had uninterrupted."""
    prompt = [1, 21, 22, 23, 24]
    structured = pb.StructuredOutput(regex=LONG_REGEX)
    uninterrupted = await stack.stub.Complete(request(prompt, structured))
    victim = stack.stub.Generate(request(prompt, structured, request_id="sv", priority=0))
    first = await _first_chunks(victim, 3)
    vip = pb.GenerateRequest(prompt_token_ids=[1, 9, 9], priority=10, params=pb.SamplingParams(max_tokens=4))
    await stack.stub.Complete(vip)
    chunks = first + [chunk async for chunk in victim]
    record = await stack.scheduler.frontend.store.requests.get("sv")
    assert record is not None and int(record["preemptions"]) == 1
    assert joined_tokens(chunks) == list(uninterrupted.token_ids)
    assert re.fullmatch(LONG_REGEX, "".join(c.text for c in chunks))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
