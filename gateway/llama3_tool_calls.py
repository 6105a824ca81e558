"""The Llama 3 JSON tool-call syntax, as Llama 3.1-3.3 and 4 write their calls with their JSON
tool-calling templates: the whole output is one call, ``{"name": ..., "parameters": {...}}``
(``arguments`` is taken too), or several separated by ``;``, optionally after ``<|python_tag|>``.
An output that does not open with one is text. vLLM's ``llama3_json`` parser reads the same syntax.

``parse`` reads a whole output. ``Llama3Stream`` reads one as it streams: once the output's first
characters show a call it holds the rest until the end, where the calls go out together (their
arguments are known to be whole JSON only then); any other output goes out as content as it comes.
"""

from __future__ import annotations

import json

from gateway.hermes_tool_calls import ParsedCall

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
        except ValueError:
            return text, []
        call = _call(value)
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


def _call(value: object) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("parameters", value.get("arguments", {}))
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class Llama3Stream:
    """One streamed output, read piece by piece."""

    def __init__(self) -> None:
        self._held = ""  # the output so far, while it may be (or is) calls
        self._calling: bool | None = None  # unknown until the output's first characters show
        self.calls = 0  # calls sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """The content and the calls that ``text`` completes (``final``: the output ends with it)."""
        if self._calling is False:
            return text, []
        self._held += text
        if self._calling is None:
            start = self._held.lstrip()
            if not start or (PYTHON_TAG.startswith(start) and not final):
                return "", []  # nothing shows yet, or the tag may be coming
            self._calling = start.startswith("{") or start.startswith(PYTHON_TAG)
            if not self._calling:
                return self._held, []
        if not final:
            return "", []
        content, calls = parse(self._held)
        self.calls += len(calls)
        return content or "", calls
