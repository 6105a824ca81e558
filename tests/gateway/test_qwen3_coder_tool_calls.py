"""The Qwen3-Coder tool-call syntax, read whole and as it streams in pieces of any size, its values
typed by the tools' schemas."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.hermes_tool_calls import ParsedCall
from gateway.qwen3_coder_tool_calls import Qwen3CoderStream, parse
from tests.gateway.streamed_pieces import assert_streamed_as_parsed

SCHEMAS: dict[str, Any] = {
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "tags": {"type": "array"},
            "scale": {"type": "number"},
            "zip": {"type": "string"},
        },
    }
}


def _call(name: str, *parameters: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = _call("weather", ("city", "Oslo"), ("days", "3"), ("metric", "true"), ("tags", '["a", "b"]'), ("zip", "0150"))
CASES = [
    ("Just text, no call.", ("Just text, no call.", [])),
    (
        "Let me look.\n" + WEATHER,
        (
            "Let me look.\n",
            [ParsedCall("weather", '{"city": "Oslo", "days": 3, "metric": true, "tags": ["a", "b"], "zip": "0150"}')],
        ),
    ),
    (
        _call("weather", ("city", "New\nYork"), ("scale", "1.5")) + "\n" + _call("clock"),
        (None, [ParsedCall("weather", '{"city": "New\\nYork", "scale": 1.5}'), ParsedCall("clock", "{}")]),
    ),
    (_call("weather", ("days", "three")), (None, [ParsedCall("weather", '{"days": "three"}')])),  # not its type: text
    (_call("other", ("x", "5")), (None, [ParsedCall("other", '{"x": "5"}')])),  # no schema: text
    (  # no JSON form (NaN, an infinity) or nested past the parser's depth: text
        _call("weather", ("tags", "[NaN]"), ("scale", "1e999"), ("days", "[" * 5000)),
        (None, [ParsedCall("weather", '{"tags": "[NaN]", "scale": "1e999", "days": "' + "[" * 5000 + '"}')]),
    ),
    (
        "<tool_call>\n<function=weather>\n<parameter=city>\nOs",
        ("<tool_call>\n<function=weather>\n<parameter=city>\nOs", []),
    ),
    ('<tool_call>{"name": "clock"}</tool_call>', ('<tool_call>{"name": "clock"}</tool_call>', [])),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert parse(text, SCHEMAS) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_in_any_pieces_as_parsed_whole(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert_streamed_as_parsed(lambda: Qwen3CoderStream(SCHEMAS), text, expected)
