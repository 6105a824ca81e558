"""DeepSeek's tool-call syntax, in both its forms, read whole and as it streams in pieces of any size."""

from __future__ import annotations

import pytest

from gateway.deepseek_tool_calls import SEPARATOR, TAGS, DeepSeekStream, parse
from gateway.hermes_tool_calls import ParsedCall
from tests.gateway.streamed_pieces import assert_streamed_as_parsed

END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
OSLO = '{"city": "Oslo"}'
OSLO_3 = '{"city": "Oslo", "days": 3}'


def _v3(name: str, arguments: str) -> str:
    return f"{TAGS.call}function{SEPARATOR}{name}\n```json\n{arguments}\n```{TAGS.end}"


def _v31(name: str, arguments: str) -> str:
    return f"{TAGS.call}{name}{SEPARATOR}{arguments}{TAGS.end}"


CASES = [
    ("Just text, no call.", ("Just text, no call.", [])),
    (
        f"Let me look.{TAGS.sections[0]}{_v3('weather', OSLO)}{END}",
        ("Let me look.", [ParsedCall("weather", '{"city": "Oslo"}')]),
    ),
    (
        f"{TAGS.sections[0]}{_v31('weather', OSLO_3)}\n{_v31('clock', '{}')}{END}",
        (None, [ParsedCall("weather", '{"city": "Oslo", "days": 3}'), ParsedCall("clock", "{}")]),
    ),
    (  # a V3.1 call of a function named "function"
        f"{TAGS.sections[0]}{_v31('function', '{}')}{END}",
        (None, [ParsedCall("function", "{}")]),
    ),
    (  # a body that is not a call is dropped, as vLLM's pattern skips it; the rest are calls
        f"{TAGS.sections[0]}{_v31('clock', '[1]')}{_v31('clock', '{}')}{END}",
        (None, [ParsedCall("clock", "{}")]),
    ),
    (  # no call in the section: all text
        f"Hm.{TAGS.sections[0]}{_v31('clock', 'NaN')}{END}",
        (f"Hm.{TAGS.sections[0]}{_v31('clock', 'NaN')}{END}", []),
    ),
    (  # cut short inside the arguments
        f'{TAGS.sections[0]}{TAGS.call}clock{SEPARATOR}{{"a',
        (f'{TAGS.sections[0]}{TAGS.call}clock{SEPARATOR}{{"a', []),
    ),
    (  # cut short after a whole call
        f"{TAGS.sections[0]}{_v31('clock', '{}')}{TAGS.call}wea",
        (None, [ParsedCall("clock", "{}")]),
    ),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_in_any_pieces_as_parsed_whole(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert_streamed_as_parsed(DeepSeekStream, text, expected)


def test_each_call_goes_out_once_its_end_tag_arrives() -> None:
    stream = DeepSeekStream()
    assert stream.feed(f"Sure.{TAGS.sections[0]}{TAGS.call}clock{SEPARATOR}{{}}", final=False) == ("Sure.", [])
    assert stream.feed(f"{TAGS.end}{TAGS.call}wea", final=False) == ("", [ParsedCall("clock", "{}")])
    assert stream.feed(f"ther{SEPARATOR}{{}}{TAGS.end}{END}", final=True) == ("", [ParsedCall("weather", "{}")])
