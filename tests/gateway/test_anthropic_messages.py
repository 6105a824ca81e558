"""Anthropic's Messages API as the chat request it amounts to, and its answers, without a server."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.anthropic_messages import MessageEvents, chat_body, error_body, message_of
from gateway.errors import BadRequest, GatewayError
from gateway.openai_types import parse_chat

CLOCK = {"name": "clock", "description": "The time", "input_schema": {"type": "object", "properties": {}}}


def test_a_messages_request_is_a_chat_request() -> None:
    chat = chat_body(
        {
            "model": "m",
            "max_tokens": 64,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Time?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "They ask the time.", "signature": ""},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "t1", "name": "clock", "input": {"tz": "UTC"}},
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "noon"}]},
            ],
            "stop_sequences": ["\n\n"],
            "tools": [CLOCK],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "thinking": {"type": "disabled"},
            "metadata": {"user_id": "u1"},
            "top_k": 5,
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "clock", "arguments": '{"tz": "UTC"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "noon"},
    ]
    assert (chat["max_tokens"], chat["stop"], chat["user"], chat["top_k"]) == (64, ["\n\n"], "u1", 5)
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "clock", "parameters": CLOCK["input_schema"], "description": "The time"},
        }
    ]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": False, "thinking": False}
    parse_chat(chat)  # and the chat route takes it


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "Hi"}]}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "web_search"}]},
            "tools",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "x"}},
            "tool_choice",
        ),
        ({"max_tokens": 5, "messages": []}, "messages"),
    ],
)
def test_what_the_chat_route_cannot_serve_is_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        chat_body(body)
    assert err.value.param == param


def _completion(finish: str, stop_reason: Any = None, **message: Any) -> dict[str, Any]:
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    choice = {
        "index": 0,
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "message": {"role": "assistant", **message},
    }
    return {"id": "chatcmpl-r1", "created": 7, "model": "m", "choices": [choice], "usage": usage}


def test_a_chat_completion_is_a_message_of_content_blocks() -> None:
    call = {"id": "t1", "type": "function", "function": {"name": "clock", "arguments": '{"tz": "UTC"}'}}
    message = message_of(_completion("tool_calls", content="Checking.", reasoning="Hm.", tool_calls=[call]))
    assert message["id"] == "msg_r1" and message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [
        {"type": "thinking", "thinking": "Hm.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "t1", "name": "clock", "input": {"tz": "UTC"}},
    ]
    assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", None)
    # Anthropic counts the prompt tokens read from a cache apart from the rest.
    assert message["usage"] == {
        "input_tokens": 1,
        "cache_read_input_tokens": 8,
        "cache_creation_input_tokens": 0,
        "output_tokens": 4,
    }
    stopped = message_of(_completion("stop", "\n\n", content="Hi"))
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "\n\n")
    assert message_of(_completion("stop", 7, content="Hi"))["stop_reason"] == "end_turn"  # a stop token
    assert message_of(_completion("length", content="Hi"))["stop_reason"] == "max_tokens"


def test_a_forced_tool_call_stops_for_tool_use_and_a_cancelled_answer_stops_for_nothing() -> None:
    # A named tool_choice is structured output: the chat finish is "stop", but the answer is a call.
    call = {"id": "t1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}
    assert message_of(_completion("stop", tool_calls=[call]))["stop_reason"] == "tool_use"
    assert message_of(_completion("abort", content="Hal"))["stop_reason"] is None  # not a finished turn


def test_a_prefilled_answer_is_continued_and_a_stream_says_its_input_from_the_start() -> None:
    prefilled = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here"}]
    chat = chat_body({"max_tokens": 8, "messages": prefilled, "stream": True})
    assert (chat["continue_final_message"], chat["add_generation_prompt"]) == (True, False)
    assert chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "continue_final_message" not in chat_body({"max_tokens": 8, "messages": prefilled[:1]})
    events = MessageEvents()
    first = {**_chunk({"role": "assistant", "content": ""}), "usage": {"prompt_tokens": 9, "completion_tokens": 0}}
    assert events.feed(first)[0]["message"]["usage"]["input_tokens"] == 9


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]
    return {"id": "chatcmpl-r1", "created": 7, "model": "m", "choices": choices, "usage": None}


def test_a_chat_stream_is_anthropic_s_events() -> None:
    events = MessageEvents()
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning": "Hm."}),
        _chunk({"content": "Check"}),
        _chunk({"content": "ing."}),
        _chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "t1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}
                ]
            }
        ),
        _chunk({}, finish="tool_calls", stop_reason=None),
        {**_chunk(), "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}},
    ]
    out = [event for chunk in chunks for event in events.feed(chunk)] + events.end()
    assert [(e["type"], e.get("index")) for e in out] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert out[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert out[5]["delta"] == {"type": "text_delta", "text": "Check"}
    assert out[8]["content_block"] == {"type": "tool_use", "id": "t1", "name": "clock", "input": {}}
    assert out[9]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}
    assert (
        out[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
        and out[-2]["usage"]["output_tokens"] == 4
    )


def test_errors_take_anthropic_s_shape() -> None:
    assert error_body(GatewayError(429, "queue full")) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "queue full"},
    }
    events = MessageEvents()
    events.feed(_chunk({"content": "Hi"}))
    (error,) = events.feed({"error": {"message": "boom"}})
    assert error == {"type": "error", "error": {"type": "api_error", "message": "boom"}} and events.end() == []
