"""The Hermes tool-call syntax, as Hermes 2 Pro and 3, Qwen 2.5 and later Qwen models write their
calls (and the generated models' chat template renders them): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the output, and the text before the
first call is the message's content. vLLM's ``hermes`` parser reads the same syntax.

Qwen3-Coder's syntax puts other bodies between the same tags (``qwen3_coder_tool_calls``): both
read a body with ``read_call``.

``HermesStream`` reads an output as it streams: text goes out as content until the first call
opens (a tail that may be the start of the opening tag is held back), and each call goes out once
it closes, or at the end if what is left parses, since its arguments are known to be whole JSON
only then; text between and after calls is dropped. Something between the tags that is not such a
call is text where no call came before it, and dropped after one (a second call cut short by
``max_tokens``, say): the calls already sent stand, as vLLM's stream sends them. ``parse`` reads a
whole output as that stream does, in one piece, so the two never disagree (vLLM's whole reading
makes an output with any such body all text).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from gateway.split_tags import tag_prefix_len

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    call_id: str = ""  # the model's own id for the call, in a syntax that writes one (Kimi K2's)


# One call's body, between the tags, as a call (None: it is not one).
ReadCall = Callable[[str], "ParsedCall | None"]


def parse(text: str, read_call: ReadCall | None = None) -> tuple[str | None, list[ParsedCall]]:
    """The content before the first call (None if empty) and the calls; ``(text, [])`` where the
    output makes no call."""
    content, calls = HermesStream(read_call).feed(text, final=True)
    return (content or None, calls) if calls else (text, [])


def _call(body: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    return json_call(value)


def json_call(value: object, keys: tuple[str, ...] = ("arguments",)) -> ParsedCall | None:
    """A decoded ``{"name": ..., KEY: {...}}`` as a call, its arguments under the first of ``keys``
    it has (none: ``{}``); None where it is not one, or its arguments have no JSON form."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: object = next((value[key] for key in keys if key in value), {})
    try:
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except ValueError:  # NaN or an infinity, which JSON has no form for
        return None


def json_object(text: str) -> str | None:
    """``text`` as the JSON text of an object, the arguments of a call (None: it is not one)."""
    try:
        value = json.loads(text)
        return json.dumps(value, ensure_ascii=False, allow_nan=False) if isinstance(value, dict) else None
    except (ValueError, RecursionError):  # not JSON, NaN or an infinity, or nested past the parser's depth
        return None


class HermesStream:
    """One streamed output, read piece by piece."""

    def __init__(self, read_call: ReadCall | None = None) -> None:
        self._read_call = read_call or _call
        self._pending = ""  # text not sent yet: a possible start of OPEN, or an open call's body
        self._in_call = False
        self._scanned = 0  # how far the open call's body is known to hold no CLOSE
        self.calls = 0  # calls sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """The content and the calls that ``text`` completes (``final``: the output ends with it).
        As a whole output reads, the content is what comes before the first call."""
        self._pending += text
        content, calls = "", list[ParsedCall]()
        while True:
            before_calls = not self.calls and not calls
            if not self._in_call:
                start = self._pending.find(OPEN)
                if start < 0:
                    keep = 0 if final else tag_prefix_len(self._pending, OPEN)
                    if before_calls:
                        content += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                if before_calls:
                    content += self._pending[:start]
                self._pending = self._pending[start + len(OPEN) :]
                self._in_call, self._scanned = True, 0
                continue
            # Resumed where the last search stopped: a long call costs its length once, however
            # many pieces it streams in.
            end = self._pending.find(CLOSE, self._scanned)
            if end < 0 and not final:
                self._scanned = max(0, len(self._pending) - len(CLOSE) + 1)
                break
            body = self._pending if end < 0 else self._pending[:end]
            self._pending = "" if end < 0 else self._pending[end + len(CLOSE) :]
            self._in_call = False
            call = self._read_call(body)
            if call is not None:
                calls.append(call)
            elif before_calls:  # not a call after all: text
                content += OPEN + body + ("" if end < 0 else CLOSE)
            if end < 0:
                break
        self.calls += len(calls)
        return content, calls
