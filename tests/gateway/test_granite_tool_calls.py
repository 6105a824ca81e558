"""IBM Granite's tool-call syntax, read whole and as it streams in pieces of any size."""

from __future__ import annotations

import pytest

from gateway.granite_tool_calls import GraniteStream, parse
from gateway.hermes_tool_calls import ParsedCall
from tests.gateway.streamed_pieces import assert_streamed_as_parsed

CALLS = '[{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "clock", "arguments": {}}]'
BOTH = [ParsedCall("weather", '{"city": "Oslo"}'), ParsedCall("clock", "{}")]
CASES = [
    ("Just text, no call.", ("Just text, no call.", [])),
    (CALLS, (None, BOTH)),
    ("<|tool_call|>" + CALLS, (None, BOTH)),  # Granite 3.0's special token
    (" <tool_call> " + CALLS + "\n", (None, BOTH)),  # Granite 3.1's text
    ("[1] is a footnote.", ("[1] is a footnote.", [])),
    ('[{"name": "clock"}, {"arguments": {}}]', ('[{"name": "clock"}, {"arguments": {}}]', [])),  # one is no call
    ('[{"name": "clock", "arguments": {"x": NaN}}]', ('[{"name": "clock", "arguments": {"x": NaN}}]', [])),
    ("[" * 5000, ("[" * 5000, [])),  # nested past the parser's depth: text, not an error
    ("[]", ("[]", [])),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_in_any_pieces_as_parsed_whole(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert_streamed_as_parsed(GraniteStream, text, expected)
