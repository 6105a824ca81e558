"""GLM-4.5's tool-call syntax, read whole and as it streams in pieces of any size, its values read
by the tools' schemas."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.glm_tool_calls import GlmStream, parse
from gateway.hermes_tool_calls import ParsedCall
from tests.gateway.streamed_pieces import assert_streamed_as_parsed

SCHEMAS: dict[str, Any] = {
    "weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}},
    }
}


def _call(name: str, *arguments: tuple[str, str], newlines: bool = True) -> str:
    gap = "\n" if newlines else ""
    pairs = "".join(f"<arg_key>{key}</arg_key>{gap}<arg_value>{value}</arg_value>{gap}" for key, value in arguments)
    return f"<tool_call>{name}{gap}{pairs}</tool_call>"


CASES = [
    ("Just text, no call.", ("Just text, no call.", [])),
    (
        "Let me look.\n" + _call("weather", ("city", " Oslo "), ("days", "3"), ("zip", "0150")),
        ("Let me look.\n", [ParsedCall("weather", '{"city": " Oslo ", "days": 3, "zip": "0150"}')]),
    ),
    (  # GLM-4.7: no newline after the name or between the pairs
        _call("weather", ("city", "Oslo"), ("tags", '["a", "b"]'), newlines=False) + _call("clock"),
        (None, [ParsedCall("weather", '{"city": "Oslo", "tags": ["a", "b"]}'), ParsedCall("clock", "{}")]),
    ),
    (  # not strings by the schema: JSON, else a Python literal, else the text; NaN is not JSON
        _call("other", ("a", "{'x': True, 'y': None}"), ("b", "three"), ("c", "NaN"), ("d", "{1, 2}")),
        (None, [ParsedCall("other", '{"a": {"x": true, "y": null}, "b": "three", "c": "NaN", "d": "{1, 2}"}')]),
    ),
    (
        "<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Os",
        ("<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Os", []),
    ),
    ('<tool_call>{"name": "clock"}</tool_call>', ('<tool_call>{"name": "clock"}</tool_call>', [])),
    (  # a call cut short by max_tokens is dropped, as one that is not a call: the others stand (vLLM's reading)
        _call("clock") + "<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Os",
        (None, [ParsedCall("clock", "{}")]),
    ),
    ("<tool_call></tool_call> and <tool_call>clock</tool_call>", (None, [ParsedCall("clock", "{}")])),
    (_call("other", ("big", "1e999")), (None, [ParsedCall("other", '{"big": "1e999"}')])),  # inf: no JSON form
    ("<tool_call>clock and more</tool_call>", ("<tool_call>clock and more</tool_call>", [])),
    # No end tag: a tag the text mentions, or a name cut short by max_tokens, is no call (vLLM's reading).
    ("I like <tool_call> tags", ("I like <tool_call> tags", [])),
    ("Sure.<tool_call>get_weath", ("Sure.<tool_call>get_weath", [])),
    (_call("clock") + "<tool_call>weather", (None, [ParsedCall("clock", "{}")])),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert parse(text, SCHEMAS) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_in_any_pieces_as_parsed_whole(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert_streamed_as_parsed(lambda: GlmStream(SCHEMAS), text, expected)


def test_a_long_body_that_is_not_a_call_is_read_in_linear_time() -> None:
    """A key or value ends at its first closing tag, so a malformed body cannot make the reader
    backtrack through every way of pairing its tags."""
    body = "<arg_key>a</arg_key><arg_value>b</arg_value>" * 5000
    text = f"<tool_call>f{body}junk</tool_call>"
    assert parse(text, SCHEMAS) == (text, [])
