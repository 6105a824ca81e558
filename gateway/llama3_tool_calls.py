"""The Llama 3 JSON tool-call syntax, as Llama 3.1-3.3 and 4 write their calls with their JSON
tool-calling templates: the whole output is one call, ``{"name": ..., "parameters": {...}}``
(``arguments`` is taken too), or several separated by ``;``, optionally after ``<|python_tag|>``.
An output that does not open with one is text. vLLM's ``llama3_json`` parser reads the same syntax.

``parse`` reads a whole output, ``Llama3Stream`` one as it streams (``whole_output_calls``).
"""

from __future__ import annotations

import json

from gateway import hermes_tool_calls
from gateway.hermes_tool_calls import ParsedCall
from gateway.whole_output_calls import WholeOutputStream

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """``(None, calls)`` where the whole output is calls; ``(text, [])`` otherwise."""
    body = text.strip()
    body = body[len(PYTHON_TAG) :].lstrip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    calls = []
    at = 0
    while at < len(body):
        try:
            value, end = _DECODER.raw_decode(body, at)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return text, []
        call = json_call(value)
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


def json_call(value: object) -> ParsedCall | None:
    """A decoded ``{"name": ..., "parameters" or "arguments": ...}`` as a call (None: it is not one)."""
    return hermes_tool_calls.json_call(value, ("parameters", "arguments"))


class Llama3Stream(WholeOutputStream):
    """One streamed output, read piece by piece."""

    def __init__(self) -> None:
        super().__init__(parse, ("{", PYTHON_TAG))
