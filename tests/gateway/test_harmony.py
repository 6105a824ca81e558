"""gpt-oss's harmony messages split into thinking, answer and calls, whole and as they stream in
pieces of any size; the ``openai`` tool-call parser reading the calls the split leaves."""

from __future__ import annotations

import pytest

from gateway import harmony_tool_calls
from gateway.harmony import HarmonySplit, split
from gateway.harmony_tool_calls import HarmonyCallStream
from gateway.hermes_tool_calls import ParsedCall
from tests.gateway.streamed_pieces import assert_streamed_as_parsed, random_pieces

THINK = "<|channel|>analysis<|message|>Let me check the weather.<|end|>"
NEXT = "<|start|>assistant"
CALL_AFTER = '<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}'
CALL_BEFORE = " to=functions.clock<|channel|>commentary json<|message|>{}<|call|>"
WEATHER = '<|start|>functions.weather<|message|>{"city": "Oslo"}<|call|>'

SPLITS = [
    (THINK + NEXT + "<|channel|>final<|message|>Sunny.<|return|>", ("Let me check the weather.", "Sunny.")),
    (THINK + NEXT + CALL_AFTER, ("Let me check the weather.", WEATHER)),
    (  # a preamble, then a call with its recipient in the role's part of the header
        NEXT + "<|channel|>commentary<|message|>On it.<|end|>" + NEXT + CALL_BEFORE,
        (None, "On it.<|start|>functions.clock<|message|>{}<|call|>"),
    ),
    (  # two analysis messages, a call to a built-in tool (dropped), the final answer without its stop token
        THINK
        + NEXT
        + "<|channel|>analysis to=browser.search<|message|>{}<|call|>"
        + THINK
        + NEXT
        + "<|channel|>final<|message|>Done",
        ("Let me check the weather.\nLet me check the weather.", "Done"),  # a line between messages
    ),
    ("Just text, no harmony.", (None, "Just text, no harmony.")),
    ("x" * 600 + "<|message|>y", (None, "x" * 600 + "<|message|>y")),  # no header so long: not harmony
    (THINK + NEXT + "<|channel|>fin", ("Let me check the weather.", None)),  # a header cut short
]


@pytest.mark.parametrize(("text", "expected"), SPLITS)
def test_split_whole_and_streamed_in_any_pieces(text: str, expected: tuple[str | None, str | None]) -> None:
    assert split(text) == expected
    for pieces in random_pieces(text):
        stream = HarmonySplit()
        parts = [stream.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        thought, answer = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        assert (thought or None, answer or None) == expected, pieces


CALLS = [
    ("Sunny.", ("Sunny.", [])),
    (WEATHER, (None, [ParsedCall("weather", '{"city": "Oslo"}')])),
    ("On it." + WEATHER + WEATHER, ("On it.", [ParsedCall("weather", '{"city": "Oslo"}')] * 2)),
    # Arguments that are not a JSON object are passed on as written, as vLLM's parser passes them.
    ("<|start|>functions.clock<|message|>[1]<|call|>", (None, [ParsedCall("clock", "[1]")])),
    ("<|start|>clock<|message|>{}<|call|>", ("<|start|>clock<|message|>{}<|call|>", [])),  # no function's name
]


@pytest.mark.parametrize(("text", "expected"), CALLS)
def test_calls_whole_and_streamed(text: str, expected: tuple[str | None, list[ParsedCall]]) -> None:
    assert harmony_tool_calls.parse(text) == expected
    assert_streamed_as_parsed(HarmonyCallStream, text, expected)


def test_calls_are_dropped_where_the_request_s_tools_may_not_be_called() -> None:
    text = THINK + NEXT + "<|channel|>commentary<|message|>On it.<|end|>" + NEXT + CALL_BEFORE
    assert split(text, keep_calls=False) == ("Let me check the weather.", "On it.")


def test_an_output_that_is_not_harmony_streams_as_it_comes() -> None:
    stream = HarmonySplit()
    assert stream.feed("Plain", final=False) == ("", "")  # it may yet be a header
    assert stream.feed(" text " * 100, final=False) == ("", "Plain" + " text " * 100)
    assert stream.feed("more", final=False) == ("", "more")


def test_a_call_cut_short_by_the_token_limit_is_dropped_whole_and_streamed() -> None:
    """A finished call's stop token may not show in the text: only the finish reason tells a call
    the token limit cut short, which is no call (vLLM reads finished messages only)."""
    text = THINK + NEXT + "<|channel|>commentary<|message|>On it.<|end|>" + NEXT + CALL_AFTER
    assert split(text, cut_short=True) == ("Let me check the weather.", "On it.")
    assert split(text) == ("Let me check the weather.", "On it." + WEATHER)  # stopped at its <|call|>
    for pieces in random_pieces(text):
        stream = HarmonySplit()
        parts = [
            stream.feed(piece, final=i == len(pieces) - 1, cut_short=i == len(pieces) - 1)
            for i, piece in enumerate(pieces)
        ]
        assert "".join(p[1] for p in parts) == "On it.", pieces
