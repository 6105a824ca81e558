"""The Mistral tool-call syntax, read whole and as it streams in pieces of any size."""

from __future__ import annotations

import re

import pytest

from gateway.hermes_tool_calls import ParsedCall
from gateway.mistral_tool_calls import MistralStream, call_id, parse
from tests.gateway.streamed_pieces import assert_streamed_as_parsed

WEATHER = ParsedCall("weather", '{"city": "Oslo"}')
CLOCK = ParsedCall("clock", "{}")
CASES = [
    ("Just text, no call.", ("Just text, no call.", [])),
    ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "clock"}]', (None, [WEATHER, CLOCK])),
    ('Let me look. [TOOL_CALLS] {"name": "weather", "arguments": {"city": "Oslo"}}', ("Let me look. ", [WEATHER])),
    ('[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]clock[ARGS]{}', (None, [WEATHER, CLOCK])),
    ('[TOOL_CALLS]weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}', (None, [WEATHER])),
    ('[TOOL_CALLS]weather{"city": "Oslo"}', (None, [WEATHER])),
    ("[TOOL_CALLS]", ("[TOOL_CALLS]", [])),
    ("[TOOL_CALLS][]", ("[TOOL_CALLS][]", [])),
    ("Odd [TOOL_CALLS] words", ("Odd [TOOL_CALLS] words", [])),
    ('[TOOL_CALLS]weather[ARGS]{"city": "Os', ('[TOOL_CALLS]weather[ARGS]{"city": "Os', [])),  # cut short
    ('[TOOL_CALLS]weather[ARGS]["Oslo"]', ('[TOOL_CALLS]weather[ARGS]["Oslo"]', [])),  # arguments not an object
    ("a [TOOL", ("a [TOOL", [])),
    ('[TOOL_CALLS]clock[ARGS]{"x": NaN}', ('[TOOL_CALLS]clock[ARGS]{"x": NaN}', [])),  # no JSON form
    ("[TOOL_CALLS]" + "[" * 5000, ("[TOOL_CALLS]" + "[" * 5000, [])),  # nested past the parser's depth: text
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_in_any_pieces_as_parsed_whole(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert_streamed_as_parsed(MistralStream, text, expected)


def test_content_streams_until_the_marker() -> None:
    stream = MistralStream()
    assert stream.feed("Let me [TOOL", final=False) == ("Let me ", [])
    assert stream.feed("_CALLS]clock[ARGS]", final=False) == ("", [])
    assert stream.feed("{}", final=True) == ("", [CLOCK])


def test_call_ids_are_what_mistral_templates_accept() -> None:
    ids = {call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
