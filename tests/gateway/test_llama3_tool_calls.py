"""The Llama 3 JSON tool-call syntax, read whole and as it streams in pieces of any size."""

from __future__ import annotations

import pytest

from gateway.hermes_tool_calls import ParsedCall
from gateway.llama3_tool_calls import Llama3Stream, parse
from tests.gateway.streamed_pieces import assert_streamed_as_parsed

WEATHER = '{"name": "weather", "parameters": {"city": "Oslo"}}'
CASES = [
    ("Just text, no call.", ("Just text, no call.", [])),
    (WEATHER, (None, [ParsedCall("weather", '{"city": "Oslo"}')])),
    ("<|python_tag|>" + WEATHER, (None, [ParsedCall("weather", '{"city": "Oslo"}')])),
    (
        " \n" + WEATHER + '; {"name": "clock", "arguments": {}}',
        (None, [ParsedCall("weather", '{"city": "Oslo"}'), ParsedCall("clock", "{}")]),
    ),
    ('{"name": "clock"}', (None, [ParsedCall("clock", "{}")])),
    ('{"city": "Oslo"}', ('{"city": "Oslo"}', [])),  # JSON, but no call
    ('{"name": "weather", "parameters": {"ci', ('{"name": "weather", "parameters": {"ci', [])),  # cut short
    ("<|python", ("<|python", [])),
    ("A {curly} answer", ("A {curly} answer", [])),
    (
        '{"name": "clock", "parameters": {"x": NaN}}',
        ('{"name": "clock", "parameters": {"x": NaN}}', []),
    ),  # no JSON form
    ('{"name": "x", "parameters": ' + "[" * 5000, ('{"name": "x", "parameters": ' + "[" * 5000, [])),  # too deep: text
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_in_any_pieces_as_parsed_whole(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert_streamed_as_parsed(Llama3Stream, text, expected)


def test_text_streams_as_it_comes_once_it_shows_no_call() -> None:
    stream = Llama3Stream()
    assert stream.feed("  ", final=False) == ("", [])
    assert stream.feed("Sure", final=False) == ("  Sure", [])
    assert stream.feed(", here.", final=True) == (", here.", [])
