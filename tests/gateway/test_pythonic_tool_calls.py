"""The pythonic tool-call syntax, read whole and as it streams in pieces of any size."""

from __future__ import annotations

import pytest

from gateway.hermes_tool_calls import ParsedCall
from gateway.pythonic_tool_calls import PythonicStream, parse
from tests.gateway.streamed_pieces import assert_streamed_as_parsed

WEATHER = ParsedCall("weather", '{"city": "Oslo", "days": 3}')
CASES = [
    ("Just text, no call.", ("Just text, no call.", [])),
    ('[weather(city="Oslo", days=3)]', (None, [WEATHER])),
    (" \n[weather(city='Oslo', days=3), clock()]\n", (None, [WEATHER, ParsedCall("clock", "{}")])),
    ("<|python_start|>[clock()]<|python_end|>", (None, [ParsedCall("clock", "{}")])),
    (
        "[f(flag=True, none=None, pair=(1, 2.5), nested={'k': [False]}, t='ü')]",
        (None, [ParsedCall("f", '{"flag": true, "none": null, "pair": [1, 2.5], "nested": {"k": [false]}, "t": "ü"}')]),
    ),
    ("[]", ("[]", [])),  # a list, but of no call
    ("[weather('Oslo')]", ("[weather('Oslo')]", [])),  # positional: no parameter names it
    ("[os.remove(path='x')]", ("[os.remove(path='x')]", [])),  # not a function's name
    ("[f(x=g())]", ("[f(x=g())]", [])),  # a value that would have to run
    ("[f(**kw)]", ("[f(**kw)]", [])),
    ("[f(x={1, 2})]", ("[f(x={1, 2})]", [])),  # a set has no JSON form
    ("[f(x=1e999)]", ("[f(x=1e999)]", [])),  # nor infinity
    ("[weather(city='Os", ("[weather(city='Os", [])),  # cut short
    ("[1, 2] is a list", ("[1, 2] is a list", [])),
    ("[" * 500 + "]" * 500, ("[" * 500 + "]" * 500, [])),  # nested past the parser's depth
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_in_any_pieces_as_parsed_whole(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert_streamed_as_parsed(PythonicStream, text, expected)


def test_text_streams_as_it_comes_once_it_shows_no_call() -> None:
    stream = PythonicStream()
    assert stream.feed(" <|python", final=False) == ("", [])
    assert stream.feed("ic|> is a tag", final=False) == (" <|pythonic|> is a tag", [])
    assert stream.feed(".", final=True) == (".", [])
