"""OpenAI's response_format and vLLM's structured_outputs (and guided_*) in Baton's StructuredOutput;
then served: the official ``openai`` client against ``baton gateway`` over a real stack."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema
from pydantic import BaseModel, Field

from common.pb import generate_pb2 as pb
from gateway.errors import BadRequest
from gateway.openai_structured import structured_output
from gateway.openai_types import parse_chat, parse_completion
from tests.gateway.conftest import ALIAS

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
COMPACT = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, None),
        ({"response_format": None}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, pb.StructuredOutput(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            pb.StructuredOutput(json_schema=COMPACT),
        ),
        (  # OpenAI's schema is optional: without one, any JSON object
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            pb.StructuredOutput(json_object=True),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, pb.StructuredOutput(json_schema=COMPACT)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, pb.StructuredOutput(json_schema=COMPACT)),
        ({"structured_outputs": {"regex": "[a-z]+"}}, pb.StructuredOutput(regex="[a-z]+")),
        (
            {"structured_outputs": {"choice": ["a", "b"], "regex": None}},
            pb.StructuredOutput(choice=pb.StructuredChoice(choices=["a", "b"])),
        ),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, pb.StructuredOutput(grammar='root ::= "a"')),
        ({"structured_outputs": {"json_object": True}}, pb.StructuredOutput(json_object=True)),
        (  # vLLM's options asking for what Baton does anyway
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True, "disable_fallback": False}},
            pb.StructuredOutput(regex="a"),
        ),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, pb.StructuredOutput(grammar='start: "a"')),  # Lark
        ({"guided_json": SCHEMA}, pb.StructuredOutput(json_schema=COMPACT)),
        ({"guided_regex": "x"}, pb.StructuredOutput(regex="x")),
        ({"guided_choice": ["y"]}, pb.StructuredOutput(choice=pb.StructuredChoice(choices=["y"]))),
        ({"guided_grammar": 'root ::= "z"'}, pb.StructuredOutput(grammar='root ::= "z"')),
        ({"guided_json": SCHEMA, "response_format": {"type": "text"}}, pb.StructuredOutput(json_schema=COMPACT)),
    ],
)
def test_each_way_of_asking_maps_to_one_constraint(body: dict[str, Any], expected: pb.StructuredOutput | None) -> None:
    assert structured_output(body) == expected


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": "json"}, "response_format", "object with a type"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "a json_schema object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
            "response_format.json_schema.schema",
            "a JSON schema",
        ),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"json": "{no"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice", "non-empty list"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "must be a string"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "not supported"),
        ({"structured_outputs": {"regex": "a", "disable_fallback": "yes"}}, "structured_outputs", "true or false"),
        ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "one way only",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one way only"),
        ({"guided_json": "[1"}, "guided_json", "not valid JSON"),
        ({"guided_choice": "a"}, "guided_choice", "non-empty list"),
    ],
)
def test_bad_or_ambiguous_asks_are_400(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(BadRequest) as err:
        structured_output(body)
    assert err.value.param == param and message in err.value.message


def test_both_apis_carry_the_constraint_and_tools_stay_refused() -> None:
    fmt = {"type": "json_object"}
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "response_format": fmt})
    assert chat.request.params.structured_output == pb.StructuredOutput(json_object=True)
    completion = parse_completion({"prompt": "a", "structured_outputs": {"regex": "b+"}})
    assert completion.request.params.structured_output.regex == "b+"
    assert not parse_completion({"prompt": "a"}).request.params.HasField("structured_output")
    assert not chat.request.params.HasField("max_tokens")  # Baton's default, not an explicit 0
    with pytest.raises(BadRequest) as err:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]})
    assert err.value.param == "tools"


# ---- served: the official openai client against the gateway and a real stack ------------------
class Pet(BaseModel):
    name: str = Field(min_length=1, max_length=10)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    vaccinated: bool


def _chat(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


async def test_parse_with_a_pydantic_model(client: openai.AsyncOpenAI) -> None:
    """The client's own structured-output path: a strict JSON schema out, a validated model back."""
    for text in ("Describe a pet.", "Another one, please", "What is your favourite animal?"):
        out = await client.chat.completions.parse(
            model=ALIAS, messages=_chat(text), response_format=Pet, max_tokens=200, temperature=0
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
        assert Pet.model_validate_json(choice.message.content or "") == choice.message.parsed


async def test_streamed_json_schema_chunks_join_to_valid_json(client: openai.AsyncOpenAI) -> None:
    schema = Pet.model_json_schema()
    stream = await client.chat.completions.create(
        model=ALIAS,
        messages=_chat("A pet as JSON"),
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
        max_tokens=200,
        temperature=0.8,  # sampled: the mask holds whatever is drawn
        seed=7,
        stream=True,
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_vllm_extensions_on_completions(client: openai.AsyncOpenAI) -> None:
    regex = r"[A-Z][a-z]{2,6} [0-9]{2}"
    out = await client.completions.create(
        model=ALIAS,
        prompt="Name and age:",
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert re.fullmatch(regex, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    choices = ["positive", "negative", "neutral"]
    out = await client.completions.create(
        model=ALIAS, prompt="Sentiment:", max_tokens=10, temperature=0, extra_body={"guided_choice": choices}
    )
    assert out.choices[0].text in choices
    grammar = 'root ::= "SELECT " col (", " col){0,2} " FROM t"\ncol ::= "a" | "b" | "c"'
    out = await client.completions.create(
        model=ALIAS,
        prompt="SQL:",
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"SELECT [abc](, [abc]){0,2} FROM t", out.choices[0].text)


async def test_json_object_on_chat(client: openai.AsyncOpenAI) -> None:
    out = await client.chat.completions.create(
        model=ALIAS, messages=_chat("{}"), response_format={"type": "json_object"}, max_tokens=100, temperature=0
    )
    # Any object may hold endless strings; on this conversation the tiny model closes its object.
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


async def test_bad_schemas_and_unsupported_asks_are_400(client: openai.AsyncOpenAI) -> None:
    bad_schema: ResponseFormatJSONSchema = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}},
    }
    with pytest.raises(openai.BadRequestError, match="structured_output json_schema"):  # Baton's check, passed on
        await client.chat.completions.create(model=ALIAS, messages=_chat("hi"), response_format=bad_schema)
    with pytest.raises(openai.BadRequestError, match="structured_output regex"):
        await client.completions.create(model=ALIAS, prompt="x", extra_body={"guided_regex": "(a"})
    with pytest.raises(openai.BadRequestError, match="tools"):
        await client.chat.completions.create(
            model=ALIAS,
            messages=_chat("hi"),
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        )
