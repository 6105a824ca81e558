"""Streaming for tool-call syntaxes in which the whole output is the calls (Llama 3's JSON calls,
pythonic calls): whether an output calls shows in its first characters, and its calls are known to
be whole only at its end.

``WholeOutputStream`` reads one such output as it streams: once the output's first non-blank
characters open a call it holds the rest until the end, where the calls go out together; any other
output goes out as content as it comes. At the end it reads exactly as its syntax's ``parse``
reads the whole output, so a stream and a whole answer never disagree.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.hermes_tool_calls import ParsedCall

Parse = Callable[[str], tuple[str | None, list[ParsedCall]]]


class WholeOutputStream:
    """One streamed output whose calls, if any, open it with one of ``openers``."""

    def __init__(self, parse: Parse, openers: tuple[str, ...]) -> None:
        self._parse = parse
        self._openers = openers
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
            if not final and (not start or any(o.startswith(start) and o != start for o in self._openers)):
                return "", []  # nothing shows yet, or an opener may be coming
            self._calling = start.startswith(self._openers)
            if not self._calling:
                return self._held, []
        if not final:
            return "", []
        content, calls = self._parse(self._held)
        self.calls += len(calls)
        return content or "", calls
