"""Tool-call syntaxes that put every call in one section of the output, each between its own tags,
as DeepSeek's and Kimi K2's templates write them:

    content<section><call>body<end>…<call>body<end></section>

and GLM-4.5's, whose calls have no section tag: the first call's tag opens the section. The text
before the section is the message's content; what a body holds is the family's
(``deepseek_tool_calls``, ``kimi_k2_tool_calls``, ``glm_tool_calls``). A body that does not read as
a call, or has no end tag (cut short, or a tag the text only mentions), is dropped, as vLLM's
parsers of these families skip what their patterns do not match; an output whose section holds no
call at all is text.

``SectionedStream`` reads an output as it streams: content goes out until
the section opens (a tail that may be the start of its tag is held back), and each call once its end
tag arrives. An output whose section never gives a call
goes out whole as content at its end. ``parse`` reads a whole output as that stream does, in one
piece, so a stream and a whole answer never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.hermes_tool_calls import ParsedCall, ReadCall
from gateway.split_tags import tag_prefix_len


@dataclass(frozen=True)
class SectionTags:
    sections: tuple[str, ...]  # what opens the calls' section, each spelling the model may write
    call: str  # opens one call; it may be the section's opener too (GLM's calls have no section tag)
    end: str  # closes one call

    def opening(self, text: str) -> tuple[int, str] | None:
        """Where the section opens in ``text``, and the tag that opens it (None: it does not)."""
        found = [(at, tag) for tag in self.sections if (at := text.find(tag)) >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many of ``text``'s last characters may begin a section tag."""
        return tag_prefix_len(text, *self.sections)

    def first_call(self, tag: str) -> int:
        """Where, from the section's tag on, the first call's tag is looked for: at the section's
        tag itself where that is a call's tag."""
        return 0 if tag == self.call else len(tag)


def parse(text: str, tags: SectionTags, read_call: ReadCall) -> tuple[str | None, list[ParsedCall]]:
    """The content before the section (None if empty) and its calls; ``(text, [])`` where the output
    has no section or its section no call."""
    content, calls = SectionedStream(tags, read_call).feed(text, final=True)
    return (content or None, calls) if calls else (text, [])


class SectionedStream:
    """One streamed output, read piece by piece."""

    def __init__(self, tags: SectionTags, read_call: ReadCall) -> None:
        self._tags = tags
        self._read_call = read_call
        self._pending = ""  # before the section: a possible start of its tag
        self._section: str | None = None  # the output from the section's tag on, once it opens
        self._read = 0  # where in the section the next call's tag is looked for
        self._scanned = 0  # how far an open call's text is known to hold no end tag
        self.calls = 0  # calls sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """The content and the calls that ``text`` completes (``final``: the output ends with it)."""
        content = ""
        if self._section is None:
            self._pending += text
            opening = self._tags.opening(self._pending)
            if opening is None:
                keep = 0 if final else self._tags.held_back(self._pending)
                content, self._pending = (
                    self._pending[: len(self._pending) - keep],
                    self._pending[len(self._pending) - keep :],
                )
                return content, []
            start, tag = opening
            content, self._section, self._read = (
                self._pending[:start],
                self._pending[start:],
                self._tags.first_call(tag),
            )
            self._pending = ""
        else:
            self._section += text
        calls = self._complete_calls(self._section)
        self.calls += len(calls)
        if final and not self.calls:  # no call after all: the section was text
            content += self._section
        return content, calls

    def _complete_calls(self, section: str) -> list[ParsedCall]:
        """The calls whose end tag has arrived since the last read. Each search resumes where the
        last stopped, so a long call costs its length once, however many pieces it streams in."""
        calls = []
        call_tag, end_tag = self._tags.call, self._tags.end
        while True:
            at = section.find(call_tag, self._read)
            if at < 0:
                self._read = max(self._read, len(section) - len(call_tag) + 1)
                break
            start = at + len(call_tag)
            end = section.find(end_tag, max(start, self._scanned))
            if end < 0:  # not closed yet (at the output's end: never, and no call)
                self._read, self._scanned = at, max(start, len(section) - len(end_tag) + 1)
                break
            body = section[start:end]
            self._read, self._scanned = end + len(end_tag), 0
            if (call := self._read_call(body)) is not None:
                calls.append(call)
        return calls
