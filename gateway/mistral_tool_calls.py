"""The Mistral tool-call syntax, as Mistral's instruct models write their calls: the text before
``[TOOL_CALLS]`` is the message's content, and the calls follow it, either as a JSON array of
``{"name", "arguments"}`` objects (the tokenizers before v11: Mistral 7B v0.3, Nemo) or, from v11 on
(Mistral Small 3.1 and later, Ministral, Devstral), each call as ``[TOOL_CALLS]name[ARGS]{...}``
(v13 names a ``[CALL_ID]`` between). vLLM's ``mistral`` parser reads the same syntax.

Mistral's chat templates accept only call ids of nine letters and digits, so the calls made from
this syntax get such ids (``call_id``), as vLLM gives them.

``parse`` reads a whole output. ``MistralStream`` reads one as it streams: text goes out as content
until ``[TOOL_CALLS]`` (a tail that may be the start of it is held back); the calls go out at the
end, since their arguments are known to be whole JSON only then. What follows the marker and is not
calls makes the whole output text, as a whole output reads.
"""

from __future__ import annotations

import json
import re
import secrets
import string

from gateway.hermes_tool_calls import ParsedCall, json_call
from gateway.split_tags import tag_prefix_len

TOOL_CALLS = "[TOOL_CALLS]"
_ID_ALPHABET = string.ascii_letters + string.digits
_DECODER = json.JSONDecoder()
# A v11+ call's head: its name, a v13 call id, and the [ARGS] marker before the arguments' JSON.
_NAMED_HEAD = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*\w*\s*)?(?:\[ARGS\])?\s*")


def call_id() -> str:
    """An id Mistral's templates accept: nine letters and digits."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """The content before the calls (None if empty) and the calls; ``(text, [])`` where the output
    makes no call, or what follows the marker is not calls."""
    start = text.find(TOOL_CALLS)
    if start < 0:
        return text, []
    calls = []
    for segment in text[start + len(TOOL_CALLS) :].split(TOOL_CALLS):
        made = _calls(segment)
        if made is None:
            return text, []
        calls += made
    if not calls:
        return text, []
    return text[:start] or None, calls


def _calls(segment: str) -> list[ParsedCall] | None:
    """The calls of what one marker introduces: a JSON array or object of calls, or a named call."""
    body = segment.strip()
    if not body:
        return []  # markers written twice in a row
    if body[0] in "[{":
        value = _whole_json(body, 0)
        calls = []
        for item in value if isinstance(value, list) else [value]:
            call = json_call(item)
            if call is None:
                return None
            calls.append(call)
        return calls or None
    head = _NAMED_HEAD.match(body)
    if head is None:
        return None
    arguments = _whole_json(body, head.end())
    if not isinstance(arguments, dict):
        return None
    call = json_call({"name": head.group(1), "arguments": arguments})
    return [call] if call is not None else None


def _whole_json(body: str, at: int) -> object:
    """The JSON value at ``body[at:]`` where nothing but blanks follows it; None otherwise."""
    try:
        value, end = _DECODER.raw_decode(body, at)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    return value if not body[end:].strip() else None


class MistralStream:
    """One streamed output, read piece by piece."""

    def __init__(self) -> None:
        self._content = ""  # the content sent so far
        self._pending = ""  # text not sent yet: a possible start of the marker, or the calls
        self._calling = False  # the marker has come
        self.calls = 0  # calls sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """The content and the calls that ``text`` completes (``final``: the output ends with it)."""
        self._pending += text
        out = ""
        if not self._calling:
            start = self._pending.find(TOOL_CALLS)
            if start < 0:
                cut = len(self._pending) - (0 if final else tag_prefix_len(self._pending, TOOL_CALLS))
                out, self._pending = self._pending[:cut], self._pending[cut:]
                self._content += out
                return out, []
            out, self._pending = self._pending[:start], self._pending[start:]
            self._content += out
            self._calling = True
        if not final:
            return out, []
        calls = parse(self._content + self._pending)[1]
        self.calls += len(calls)
        return (out, calls) if calls else (out + self._pending, [])
