"""Kimi K2's tool-call syntax: a section of calls between special tokens, each call the model's own
id for it (``functions.NAME:INDEX``) and its JSON arguments,

    <|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0<|tool_call_argument_begin|>
    {"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>

(on two lines here, on one in an output). The call keeps that id, as vLLM's ``kimi_k2`` parser
keeps it: Kimi's template writes a call and its result back by it. A body that is not such a call
is dropped (``sectioned_tool_calls``).
"""

from __future__ import annotations

import re

from gateway.hermes_tool_calls import ParsedCall, json_object
from gateway.sectioned_tool_calls import SectionedStream, SectionTags
from gateway.sectioned_tool_calls import parse as parse_sectioned

# Kimi models sometimes open the section with the singular spelling, which vLLM reads too.
TAGS = SectionTags(
    sections=("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"),
    call="<|tool_call_begin|>",
    end="<|tool_call_end|>",
)
ARGUMENTS = "<|tool_call_argument_begin|>"
_ID = re.compile(r"(?:functions\.)?([^\s:<>]+):\d+")


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """The content before the calls (None if empty) and the calls; ``(text, [])`` where it makes none."""
    return parse_sectioned(text, TAGS, read_call)


class KimiK2Stream(SectionedStream):
    """One streamed output, read piece by piece."""

    def __init__(self) -> None:
        super().__init__(TAGS, read_call)


def call_id(name: str, index: int) -> str:
    """An id in Kimi's form for a call the gateway makes (a forced one): ``functions.NAME:INDEX``,
    the call's index counted over the whole conversation, as vLLM numbers them."""
    return f"functions.{name}:{index}"


def read_call(body: str) -> ParsedCall | None:
    """One call's body (None: it is not a call, or is cut short)."""
    call_id, separator, arguments = body.partition(ARGUMENTS)
    call_id = call_id.strip()
    written = _ID.fullmatch(call_id)
    parsed = json_object(arguments) if separator and written else None
    return ParsedCall(written.group(1), parsed, call_id) if written and parsed is not None else None
