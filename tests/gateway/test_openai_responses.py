"""The Responses API as the chat request it amounts to, and its answers, without a server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import BadRequest, GatewayError
from gateway.openai_responses import ResponseEvents, chat_body, response_of, responses_error
from gateway.openai_types import parse_chat

WEATHER = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}


def test_a_responses_request_is_a_chat_request() -> None:
    chat, echo = chat_body(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use metric units."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
                {"type": "reasoning", "summary": []},
            ],
            "max_output_tokens": 40,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "reasoning": {"effort": "low"},
            "top_k": 5,
            "metadata": {"trace": "t1"},
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use metric units."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]
    assert chat["max_completion_tokens"] == 40 and chat["top_k"] == 5 and chat["reasoning_effort"] == "low"
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": WEATHER["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}},
    }
    assert echo.fields["metadata"] == {"trace": "t1"} and echo.fields["tools"] == [WEATHER]
    parse_chat({**chat, "tool_choice": "none"})  # the chat route takes it (a forced call beside a format: 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "Hi", "background": True}, "background"),
        ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "Hi", "truncation": "auto"}, "truncation"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": []}, "input"),
    ],
)
def test_what_needs_a_stored_response_or_a_built_in_tool_is_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        chat_body(body)
    assert err.value.param == param


COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-r1",
    "created": 7,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": "Checking.",
                "reasoning": "They want weather.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
                ],
            },
        }
    ],
    "usage": {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    },
}


def test_a_chat_completion_is_a_response_of_items() -> None:
    _, echo = chat_body({"input": "Weather?", "tools": [WEATHER]})
    response = response_of(COMPLETION, echo)
    assert (response["id"], response["object"], response["status"], response["created_at"]) == (
        "resp_r1",
        "response",
        "completed",
        7,
    )
    assert [item["type"] for item in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][1]["content"] == [{"type": "output_text", "text": "Checking.", "annotations": []}]
    assert response["output"][2] | {"id": ""} == {
        "type": "function_call",
        "id": "",
        "call_id": "call_1",
        "name": "weather",
        "arguments": "{}",
        "status": "completed",
    }
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 8} and response["usage"]["total_tokens"] == 13
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}  # required by the SDK's types
    assert response["tools"] == [WEATHER] and response["store"] is False
    cut = json.loads(json.dumps(COMPLETION))
    cut["choices"][0]["finish_reason"] = "length"
    assert response_of(cut, echo)["incomplete_details"] == {"reason": "max_output_tokens"}


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: Any = None) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-r1", "created": 7, "model": "m", "choices": choices, "usage": usage}


def test_a_chat_stream_is_the_responses_events() -> None:
    _, echo = chat_body({"input": "Weather?", "stream": True})
    events = ResponseEvents(echo)
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning": "They want", "reasoning_content": "They want"}),
        _chunk({"reasoning": " weather."}),
        _chunk({"content": "Check"}),
        _chunk({"content": "ing."}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather"}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
        _chunk({}, finish="tool_calls"),
        _chunk(usage=COMPLETION["usage"]),
    ]
    out = [event for chunk in chunks for event in events.feed(chunk)] + events.end()
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.reasoning_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert all(e["logprobs"] == [] for e in out if e["type"].startswith("response.output_text."))
    parts = [e["part"] for e in out if e["type"].startswith("response.reasoning_part.")]
    assert parts == [{"type": "reasoning_text", "text": ""}, {"type": "reasoning_text", "text": "They want weather."}]
    (arguments,) = [e for e in out if e["type"] == "response.function_call_arguments.done"]
    assert (arguments["name"], arguments["arguments"]) == ("weather", "{}")
    final = out[-1]["response"]
    whole = response_of(COMPLETION, echo)
    assert final["output"] == whole["output"] and final["usage"] == whole["usage"]
    assert out[0]["response"]["status"] == "in_progress" and out[0]["response"]["output"] == []


def test_text_without_a_format_and_a_tool_output_of_content_parts() -> None:
    chat, _ = chat_body({"input": "Hi", "text": {"verbosity": "low"}})  # every field of text is optional
    assert "response_format" not in chat
    call = {"type": "function_call", "call_id": "c1", "name": "clock", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "noon"}]}
    chat, _ = chat_body({"input": [{"role": "user", "content": "Time?"}, call, output]})
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "noon"}


def test_a_failed_stream_ends_with_response_failed() -> None:
    events = ResponseEvents(chat_body({"input": "Hi", "stream": True})[1])
    events.feed(_chunk({"content": "Hel"}))
    (error,) = events.feed({"error": {"message": "boom", "type": "server_error", "param": None, "code": "x"}})
    assert error["type"] == "error" and error["message"] == "boom"
    last = events.end()[-1]
    assert last["type"] == "response.failed" and last["response"]["error"] == {"code": "x", "message": "boom"}


def test_null_fields_read_as_left_out_and_a_cancelled_stream_ends_as_completed_events_do() -> None:
    chat, echo = chat_body({"input": "Hi", "truncation": None, "previous_response_id": None, "include": None})
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]
    events = ResponseEvents(echo)
    events.feed(_chunk({"content": "Hel"}))
    events.feed(_chunk({}, finish="abort"))
    last = events.end()[-1]
    # The API has no event of its own for a cancelled response: its status says so.
    assert last["type"] == "response.completed" and last["response"]["status"] == "cancelled"


def test_errors_name_the_fields_a_responses_request_sent() -> None:
    chat_error = GatewayError(400, "prompt (9 tokens) + max_tokens (99) exceeds max_model_len 64", "invalid_argument")
    error = responses_error(chat_error)
    assert error.message == "prompt (9 tokens) + max_output_tokens (99) exceeds max_model_len 64"
    assert (error.status, error.code, error.param) == (400, "invalid_argument", None)
    error = responses_error(BadRequest("reasoning_effort must be one of low, medium, high", param="reasoning_effort"))
    assert (error.message, error.param) == ("reasoning.effort must be one of low, medium, high", "reasoning.effort")
    assert (
        responses_error(BadRequest("top_p must be in (0, 1]", param="top_p")).body()
        == BadRequest("top_p must be in (0, 1]", param="top_p").body()
    )
