"""IBM Granite's tool-call syntax (Granite 3.0 and later): the whole output is a JSON array of calls,
``[{"name": ..., "arguments": {...}}]``, after ``<|tool_call|>`` (3.0's special token) or
``<tool_call>`` (3.1's text), or alone. An output that is not such an array is text. vLLM's
``granite`` parser reads the same syntax.

``parse`` reads a whole output, ``GraniteStream`` one as it streams (``whole_output_calls``).
"""

from __future__ import annotations

import json

from gateway.hermes_tool_calls import ParsedCall
from gateway.llama3_tool_calls import json_call
from gateway.whole_output_calls import WholeOutputStream

TOOL_CALL_TOKEN = "<|tool_call|>"
TOOL_CALL_STRING = "<tool_call>"


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """``(None, calls)`` where the whole output is an array of calls; ``(text, [])`` otherwise."""
    body = text.strip().removeprefix(TOOL_CALL_TOKEN).removeprefix(TOOL_CALL_STRING).lstrip()
    if not body.startswith("["):
        return text, []
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return text, []
    calls = [json_call(item) for item in value] if isinstance(value, list) else []
    if not calls or None in calls:
        return text, []
    return None, [call for call in calls if call is not None]


class GraniteStream(WholeOutputStream):
    """One streamed output, read piece by piece."""

    def __init__(self) -> None:
        super().__init__(parse, ("[", TOOL_CALL_TOKEN, TOOL_CALL_STRING))
