"""Kimi K2's tool-call syntax, read whole and as it streams in pieces of any size, each call keeping
the id the model wrote."""

from __future__ import annotations

import pytest

from gateway.hermes_tool_calls import ParsedCall
from gateway.kimi_k2_tool_calls import ARGUMENTS, TAGS, KimiK2Stream, parse
from tests.gateway.streamed_pieces import assert_streamed_as_parsed

END = "<|tool_calls_section_end|>"
OSLO = '{"city": "Oslo"}'


def _call(call_id: str, arguments: str) -> str:
    return f"{TAGS.call}{call_id}{ARGUMENTS}{arguments}{TAGS.end}"


CASES = [
    ("Just text, no call.", ("Just text, no call.", [])),
    (
        f"Let me look.{TAGS.sections[0]}{_call('functions.weather:0', OSLO)}{END}",
        ("Let me look.", [ParsedCall("weather", '{"city": "Oslo"}', "functions.weather:0")]),
    ),
    (
        f"{TAGS.sections[0]}{_call(' functions.weather:3 ', '{}')}{_call('clock:4', '{}')}{END}",
        (None, [ParsedCall("weather", "{}", "functions.weather:3"), ParsedCall("clock", "{}", "clock:4")]),
    ),
    (  # the singular spelling of the section's tag, which Kimi models sometimes write
        f"<|tool_call_section_begin|>{_call('functions.clock:1', '{}')}<|tool_call_section_end|>",
        (None, [ParsedCall("clock", "{}", "functions.clock:1")]),
    ),
    (  # an id without its index is not a call
        f"{TAGS.sections[0]}{_call('functions.weather', '{}')}{END}",
        (f"{TAGS.sections[0]}{_call('functions.weather', '{}')}{END}", []),
    ),
    (
        f"{TAGS.sections[0]}{TAGS.call}functions.clock:0{ARGUMENTS}{{",
        (f"{TAGS.sections[0]}{TAGS.call}functions.clock:0{ARGUMENTS}{{", []),
    ),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_in_any_pieces_as_parsed_whole(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert_streamed_as_parsed(KimiK2Stream, text, expected)
