"""Tool calling's request reading and answer shaping, without a server."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from common import structured_grammar
from common.pb import generate_pb2 as pb
from common.structured_output import StructuredKind, StructuredOutput
from gateway.errors import BadRequest
from gateway.openai_tools import AUTO, NAMED, NONE, REQUIRED, ToolCalling, ToolCallStream, parse_tools, template_tools
from gateway.openai_types import chat_input, parse_chat, parse_completion

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "clock"}}
MESSAGES = [{"role": "user", "content": "Hi"}]


def test_a_named_function_forces_its_parameters() -> None:
    calling, tools, forced = parse_tools(
        {"tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "function": {"name": "weather"}}}
    )
    assert calling == ToolCalling(NAMED, "weather") and json.loads(tools) == [WEATHER, CLOCK]
    assert forced is not None and json.loads(forced.json_schema) == WEATHER["function"]["parameters"]
    _, _, clock = parse_tools({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "clock"}}})
    assert clock is not None and json.loads(clock.json_schema) == {"type": "object", "properties": {}}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_forces_an_array_of_calls(parallel: bool) -> None:
    calling, _, forced = parse_tools(
        {"tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": parallel}
    )
    assert calling == ToolCalling(REQUIRED, parallel=parallel) and forced is not None
    schema = json.loads(forced.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and ("maxItems" in schema) is not parallel
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["weather"], ["clock"]]


def test_required_moves_each_tools_definitions_to_the_root_of_the_calls_schema() -> None:
    # Pydantic writes a model's nested types under $defs, referenced from the root of its schema.
    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    parameters = {
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/Address"}},
        "required": ["to"],
        "$defs": {"Address": address},
    }
    ship = {"type": "function", "function": {"name": "ship", "parameters": parameters}}
    _, _, forced = parse_tools({"tools": [ship, CLOCK], "tool_choice": "required"})
    assert forced is not None
    schema = json.loads(forced.json_schema)
    assert schema["$defs"] == {"Address": address} and "$defs" not in schema["items"]["anyOf"][0]["properties"]
    grammar = structured_grammar.parse(StructuredOutput(StructuredKind.JSON_SCHEMA, forced.json_schema))
    assert grammar is not None  # the reference resolves
    other = {"type": "function", "function": {"name": "other", "parameters": {**parameters, "$defs": {"Address": {}}}}}
    with pytest.raises(BadRequest, match="differently"):
        parse_tools({"tools": [ship, other], "tool_choice": "required"})


def test_none_lists_the_tools_and_forces_nothing() -> None:
    calling, tools, forced = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert calling == ToolCalling(NONE) and tools and forced is None
    assert parse_tools({"tools": []}) == (None, "", None)
    assert parse_tools({}) == (None, "", None)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"tools": [WEATHER]}, "needs a parser"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "needs a parser"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "clock"}}},
            "not one of the tools",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "needs a name"),
        ({"tools": {"weather": WEATHER}, "tool_choice": "none"}, "tools must be a list"),
        ({"tools": [{"type": "code"}], "tool_choice": "none"}, "each tool must be"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, "needs a name"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "two tools are named"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}], "tool_choice": "none"},
            "JSON schema",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_tool_refusals(body: dict[str, Any], says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        parse_tools(body)


def test_the_chat_route_carries_tools_and_the_forcing_schema() -> None:
    named = {"type": "function", "function": {"name": "weather"}}
    parsed = parse_chat({"messages": MESSAGES, "tools": [WEATHER], "tool_choice": named})
    assert parsed.tools == ToolCalling(NAMED, "weather") and json.loads(parsed.request.chat.tools) == [WEATHER]
    assert parsed.request.params.structured_output.json_schema
    with pytest.raises(BadRequest, match="drop response_format"):
        parse_chat(
            {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": named, "response_format": {"type": "json_object"}}
        )
    with pytest.raises(BadRequest, match="tools"):
        parse_completion({"prompt": "a", "tools": [WEATHER]})
    assert template_tools({"tools": [WEATHER]}) == json.dumps([WEATHER])


def test_earlier_calls_and_their_results_reach_baton() -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c2", "function": {"name": "clock", "arguments": {}}}],
            "name": "bot",
        },
    ]
    chat = chat_input(messages)
    assert chat.messages[1].content == "" and list(chat.messages[1].tool_calls) == [
        pb.ToolCall(id="c1", name="weather", arguments='{"city": "Oslo"}')
    ]
    assert chat.messages[2].tool_call_id == "c1" and chat.messages[3].name == "bot"
    assert chat.messages[3].tool_calls[0].arguments == "{}"  # an object sent as such is written as JSON
    bad: dict[str, Any]
    for bad in (
        {"tool_calls": {}},
        {"tool_calls": [{"function": {}}]},
        {"tool_call_id": 5},
        {"tool_calls": [{"id": 3, "function": {"name": "f"}}]},
    ):
        with pytest.raises(BadRequest):
            chat_input([{"role": "assistant", "content": "", **bad}])


def test_whole_answers() -> None:
    named = ToolCalling(NAMED, "weather")
    message, finish = named.whole_message('{"city": "Oslo"}', "stop")
    assert finish == "stop" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert named.whole_message('{"ci', "length")[1] == "length"  # cut short, still the call it began

    required = ToolCalling(REQUIRED)
    text = '[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "clock", "parameters": {}}]'
    message, finish = required.whole_message(text, "stop")
    assert finish == "tool_calls" and [c["function"] for c in message["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city": "Oslo"}'},
        {"name": "clock", "arguments": "{}"},
    ]
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert required.whole_message('[{"name": "wea', "length") == (
        {"role": "assistant", "content": '[{"name": "wea'},
        "length",
    )
    assert ToolCalling(NONE).whole_message("hello", "stop") == ({"role": "assistant", "content": "hello"}, "stop")


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    stream = ToolCallStream(ToolCalling(NAMED, "weather"))
    first, finish, content = stream.feed('{"ci', None)
    assert finish is None and content == "" and first is not None
    (delta,) = first["tool_calls"]
    assert delta["index"] == 0 and delta["type"] == "function" and delta["id"].startswith("call_")
    assert delta["function"] == {"name": "weather", "arguments": '{"ci'}
    assert stream.feed("", None) == (None, None, "")
    assert stream.feed('ty": "Oslo"}', "stop") == (
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]},
        "stop",
        "",
    )
    # A first message with no text still names the call.
    assert ToolCallStream(ToolCalling(NAMED, "clock")).feed("", None)[0] is not None


def test_required_calls_go_out_once_the_array_is_whole() -> None:
    stream = ToolCallStream(ToolCalling(REQUIRED))
    assert stream.feed('[{"name": "clock", ', None) == (None, None, "")
    delta, finish, content = stream.feed('"parameters": {}}]', "stop")
    assert finish == "tool_calls" and content == "" and delta is not None
    (call,) = delta["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "clock", "arguments": "{}"}
    cut = ToolCallStream(ToolCalling(REQUIRED))
    cut.feed('[{"name": ', None)
    assert cut.feed('"clo', "length") == (None, "length", '[{"name": "clo')


def test_auto_reads_the_models_calls_with_a_parser() -> None:
    calling, tools, forced = parse_tools({"tools": [WEATHER]}, parser="hermes")
    assert calling == ToolCalling(AUTO, parser="hermes") and tools and forced is None
    hermes = ToolCalling(AUTO, parser="hermes")
    assert parse_tools({"tools": [WEATHER], "tool_choice": "auto"}, parser="hermes")[0] == hermes
    parsed = parse_chat({"messages": MESSAGES, "tools": [WEATHER]}, tool_call_parser="hermes")
    params = parsed.request.params
    assert params.HasField("skip_special_tokens") and not params.skip_special_tokens  # the tags may be special
    kept = parse_chat(
        {"messages": MESSAGES, "tools": [WEATHER], "skip_special_tokens": True}, tool_call_parser="hermes"
    )
    assert kept.request.params.skip_special_tokens

    auto = ToolCalling(AUTO, parser="hermes")
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    message, finish = auto.whole_message("Checking. " + call, "stop")
    assert finish == "tool_calls" and message["content"] == "Checking. "
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "weather", "arguments": '{"city": "Oslo"}'}]
    assert auto.whole_message("No call.", "length") == ({"role": "assistant", "content": "No call."}, "length")

    stream = ToolCallStream(auto)
    assert stream.feed("Checking. <tool", None) == (None, None, "Checking. ")
    assert stream.feed('_call>{"name": "clock"}</tool_call>', None)[0] is not None
    delta, finish, content = stream.feed(call, "stop")
    assert finish == "tool_calls" and content == "" and delta is not None
    assert [d["index"] for d in delta["tool_calls"]] == [1] and delta["tool_calls"][0]["function"]["name"] == "weather"
    plain = ToolCallStream(auto)
    assert plain.feed("Hi", None) == (None, None, "Hi") and plain.feed(" there", "stop") == (None, "stop", " there")


def test_every_call_takes_the_ids_of_the_model_family_s_syntax() -> None:
    """Mistral's templates take back only ids of nine letters and digits, forced calls' included."""
    named, _, _ = parse_tools(
        {"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "clock"}}}, parser="mistral"
    )
    assert named is not None and named.parser == "mistral"
    message, _ = named.whole_message("{}", "stop")
    stream_delta, _, _ = ToolCallStream(named).feed("{}", "stop")
    assert stream_delta is not None
    ids = [message["tool_calls"][0]["id"], stream_delta["tool_calls"][0]["id"]]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    openai_style = ToolCalling(NAMED, "clock").whole_message("{}", "stop")[0]["tool_calls"][0]["id"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", openai_style)


def test_kimi_s_forced_calls_are_numbered_over_the_conversation() -> None:
    """Kimi's template writes a call and its result back by ids ``functions.NAME:INDEX``, the index
    counting every call of the conversation: a forced call continues after those of earlier turns."""
    earlier = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [_call("functions.clock:0"), _call("functions.clock:1")]},
        {"role": "tool", "tool_call_id": "functions.clock:1", "content": "noon"},
    ]
    named, _, _ = parse_tools(
        {"messages": earlier, "tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "clock"}}},
        parser="kimi_k2",
    )
    assert named is not None
    assert named.whole_message("{}", "stop")[0]["tool_calls"][0]["id"] == "functions.clock:2"
    stream_delta, _, _ = ToolCallStream(named).feed("{}", "stop")
    assert stream_delta is not None and stream_delta["tool_calls"][0]["id"] == "functions.clock:2"
    required, _, _ = parse_tools({"messages": earlier, "tools": [CLOCK, WEATHER], "tool_choice": "required"}, "kimi_k2")
    assert required is not None
    both = json.dumps([{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "clock", "parameters": {}}])
    calls = required.whole_message(both, "stop")[0]["tool_calls"]
    assert [c["id"] for c in calls] == ["functions.weather:2", "functions.clock:3"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "clock"}}])
def test_gpt_oss_s_calls_are_read_as_written_whatever_the_choice(choice: Any) -> None:
    """No grammar here holds a harmony answer, so a forced choice is read as "auto" is."""
    calling, _, forced = parse_tools({"tools": [CLOCK], "tool_choice": choice}, parser="openai")
    assert calling is not None and calling.mode == AUTO and forced is None
    with pytest.raises(BadRequest, match="names 'weather', which is not one of the tools"):
        parse_tools({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "openai")


def _call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "clock", "arguments": "{}"}}


def test_parallel_tool_calls_false_keeps_auto_to_the_first_call() -> None:
    calls = '<tool_call>{"name": "clock"}</tool_call><tool_call>{"name": "weather", "arguments": {}}</tool_call>'
    single, _, _ = parse_tools({"tools": [WEATHER, CLOCK], "parallel_tool_calls": False}, parser="hermes")
    assert single is not None and not single.parallel
    message, finish = single.whole_message(calls, "stop")
    assert finish == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == ["clock"]
    stream = ToolCallStream(single)
    first, _, _ = stream.feed(calls[:40], None)
    second, finish, _ = stream.feed(calls[40:], "stop")
    assert first is not None and second is None and finish == "tool_calls"
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["clock"]


def test_a_tool_or_tool_choice_without_a_type_is_a_function_s() -> None:
    untyped = {"function": CLOCK["function"]}
    calling, tools, forced = parse_tools({"tools": [untyped], "tool_choice": {"function": {"name": "clock"}}})
    assert calling == ToolCalling(NAMED, "clock") and forced is not None
    assert json.loads(tools) == [CLOCK]  # the template sees the type, as it would from vLLM
