"""Tool-call syntaxes that put every call in one section of the output, each between its own tags,
as DeepSeek's and Kimi K2's templates write them:

    content<section><call>body<end>…<call>body<end></section>

The text before the section is the message's content; what a body holds is the family's
(``deepseek_tool_calls``, ``kimi_k2_tool_calls``). A body that does not read as a call is dropped,
as vLLM's parsers of these families skip what their patterns do not match; an output whose section
holds no call at all is text.

``parse`` reads a whole output. ``SectionedStream`` reads one as it streams: content goes out until
the section opens (a tail that may be the start of its tag is held back), and each call once its end
tag arrives, or at the end if what is left reads as one. An output whose section never gives a call
goes out whole as content at its end, so a stream and a whole answer never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.hermes_tool_calls import ParsedCall, ReadCall
from gateway.split_tags import tag_prefix_len


@dataclass(frozen=True)
class SectionTags:
    section: str  # opens the calls' section
    call: str  # opens one call
    end: str  # closes one call


def parse(text: str, tags: SectionTags, read_call: ReadCall) -> tuple[str | None, list[ParsedCall]]:
    """The content before the section (None if empty) and its calls; ``(text, [])`` where the output
    has no section or its section no call."""
    start = text.find(tags.section)
    if start < 0:
        return text, []
    calls = [call for body in _bodies(text[start + len(tags.section) :], tags) if (call := read_call(body))]
    return (text[:start] or None, calls) if calls else (text, [])


def _bodies(section: str, tags: SectionTags) -> list[str]:
    """Each call's body in the section; the last may be cut short (no end tag)."""
    bodies = []
    at = section.find(tags.call)
    while at >= 0:
        start = at + len(tags.call)
        end = section.find(tags.end, start)
        bodies.append(section[start:] if end < 0 else section[start:end])
        at = -1 if end < 0 else section.find(tags.call, end + len(tags.end))
    return bodies


class SectionedStream:
    """One streamed output, read piece by piece."""

    def __init__(self, tags: SectionTags, read_call: ReadCall) -> None:
        self._tags = tags
        self._read_call = read_call
        self._pending = ""  # before the section: a possible start of its tag
        self._section: str | None = None  # the output from the section's tag on, once it opens
        self._read = 0  # how much of the section has been read into calls
        self.calls = 0  # calls sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """The content and the calls that ``text`` completes (``final``: the output ends with it)."""
        content = ""
        if self._section is None:
            self._pending += text
            start = self._pending.find(self._tags.section)
            if start < 0:
                keep = 0 if final else tag_prefix_len(self._pending, self._tags.section)
                content, self._pending = (
                    self._pending[: len(self._pending) - keep],
                    self._pending[len(self._pending) - keep :],
                )
                return content, []
            content, self._section, self._read = self._pending[:start], self._pending[start:], len(self._tags.section)
            self._pending = ""
        else:
            self._section += text
        calls = self._complete_calls(self._section, final)
        self.calls += len(calls)
        if final and not self.calls:  # no call after all: the section was text
            content += self._section
        return content, calls

    def _complete_calls(self, section: str, final: bool) -> list[ParsedCall]:
        """The calls whose end tag has arrived since the last read (at the end, a cut-short one too)."""
        calls = []
        while (at := section.find(self._tags.call, self._read)) >= 0:
            start = at + len(self._tags.call)
            end = section.find(self._tags.end, start)
            if end < 0 and not final:
                break
            body = section[start:] if end < 0 else section[start:end]
            self._read = len(section) if end < 0 else end + len(self._tags.end)
            if (call := self._read_call(body)) is not None:
                calls.append(call)
        return calls
