"""Outputs cut into streamed messages at random places, for the parsers that read them."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from gateway.hermes_tool_calls import ParsedCall
from gateway.openai_tools import CallStream


def random_pieces(text: str, times: int = 30, most: int = 8) -> Iterator[list[str]]:
    """``times`` ways of cutting ``text`` into at most ``most`` + 1 pieces, the same ones every run."""
    rng = random.Random(text)
    for _ in range(times):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, most))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def read_streamed(stream: CallStream, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    """All the content and calls ``stream`` gives for ``pieces``, the last one final."""
    content, calls = "", []
    for i, piece in enumerate(pieces):
        more, made = stream.feed(piece, final=i == len(pieces) - 1)
        content += more
        calls += made
    assert stream.calls == len(calls)
    return content, calls


def assert_streamed_as_parsed(
    make_stream: Callable[[], CallStream], text: str, expected: tuple[str | None, list[ParsedCall]]
) -> None:
    """However ``text`` is cut into messages, its stream reads as the whole output parses
    (``expected``): the same calls, and the content before them (all the text where it makes none)."""
    whole_content, whole_calls = expected
    for pieces in random_pieces(text):
        content, calls = read_streamed(make_stream(), pieces)
        assert calls == whole_calls, pieces
        assert content == ((whole_content or "") if whole_calls else text), pieces
