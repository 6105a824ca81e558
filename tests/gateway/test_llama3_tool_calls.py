"""The Llama 3 JSON tool-call syntax, read whole and as it streams in pieces of any size."""

from __future__ import annotations

import random

import pytest

from gateway.hermes_tool_calls import ParsedCall
from gateway.llama3_tool_calls import Llama3Stream, parse

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
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_in_any_pieces_as_parsed_whole(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = Llama3Stream()
        content, calls = "", []
        for i, piece in enumerate(pieces):
            more, made = stream.feed(piece, final=i == len(pieces) - 1)
            content += more
            calls += made
        assert (content or None, calls) == (expected[0] if expected[1] else text, expected[1]), pieces


def test_text_streams_as_it_comes_once_it_shows_no_call() -> None:
    stream = Llama3Stream()
    assert stream.feed("  ", final=False) == ("", [])
    assert stream.feed("Sure", final=False) == ("  Sure", [])
    assert stream.feed(", here.", final=True) == (", here.", [])
