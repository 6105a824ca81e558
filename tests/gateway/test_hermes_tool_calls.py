"""The Hermes tool-call syntax, read whole and as it streams in pieces of any size."""

from __future__ import annotations

import pytest

from gateway.hermes_tool_calls import HermesStream, ParsedCall, parse
from tests.gateway.streamed_pieces import assert_streamed_as_parsed

WEATHER = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
CLOCK = '<tool_call>\n{"name": "clock"}\n</tool_call>'
CASES = [
    ("Just text, no call.", ("Just text, no call.", [])),
    (WEATHER, (None, [ParsedCall("weather", '{"city": "Oslo"}')])),
    ("Let me look. " + WEATHER, ("Let me look. ", [ParsedCall("weather", '{"city": "Oslo"}')])),
    (WEATHER + "\n" + CLOCK, (None, [ParsedCall("weather", '{"city": "Oslo"}'), ParsedCall("clock", "{}")])),
    (
        '<tool_call>{"name": "clock", "arguments": {"tz": "ü"}}',
        (None, [ParsedCall("clock", '{"tz": "ü"}')]),
    ),  # unclosed at the end
    ("<tool_call>not json</tool_call>", ("<tool_call>not json</tool_call>", [])),
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),
    ("a < b and <tool", ("a < b and <tool", [])),
    # Mixed with a body that is no call: the calls stand, whole as streamed (a stream sent them
    # before the bad body came); one before any call is content, one after is dropped.
    (WEATHER + '<tool_call>{"name": "b", "argu', (None, [ParsedCall("weather", '{"city": "Oslo"}')])),
    (
        "<tool_call>not json</tool_call>" + WEATHER,
        ("<tool_call>not json</tool_call>", [ParsedCall("weather", '{"city": "Oslo"}')]),
    ),
    (WEATHER + "<tool_call>not json</tool_call>", (None, [ParsedCall("weather", '{"city": "Oslo"}')])),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_in_any_pieces_as_parsed_whole(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert_streamed_as_parsed(HermesStream, text, expected)


def test_a_possible_tag_start_is_held_until_it_is_not() -> None:
    stream = HermesStream()
    assert stream.feed("Hello <tool", final=False) == ("Hello ", [])
    assert stream.feed("box> there", final=False) == ("<toolbox> there", [])
    assert stream.feed(" <", final=True) == (" <", [])
