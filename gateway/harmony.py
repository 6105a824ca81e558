"""gpt-oss's output, written in OpenAI's harmony format, split into its thinking, its visible answer
and its calls. The chat template ends the prompt with ``<|start|>assistant``, so an output is one
or more messages, each a header, ``<|message|>`` and a body:

    <|channel|>analysis<|message|>Let me check.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}

(on two lines here, on one in an output). A message's channel says who reads it: ``analysis`` is
the thinking; ``final``, and ``commentary`` without a recipient (a preamble), are the answer; a
message to ``functions.NAME`` (the recipient, ``to=``, in the header before or after the channel)
calls that function with the body as its arguments. A body ends at ``<|end|>``, at ``<|call|>`` or
``<|return|>`` (the stop tokens, which the output may not show), or at the next ``<|start|>``.
Messages to other recipients (the built-in ``browser`` and ``python`` tools) are dropped, as vLLM's
chat API drops them.

``HarmonySplit`` reads an output as it streams and returns its thinking and its answer: the
visible bodies (each message after the first of its kind on a line of its own), and each call, unless
the request's tools may not be called, as ``<|start|>functions.NAME<|message|>ARGS<|call|>``,
which ``harmony_tool_calls`` reads (the reasoning parser ``openai_gptoss`` and the tool-call parser
``openai``, as vLLM names them). A call goes out once its body ends; one the token limit cut short
(the stop token, which the text may not show, is all that tells a finished call's end) is dropped,
as vLLM's parser reads only finished messages. An output whose first header is not complete within its first
512 characters is not harmony: it is all answer, as written, and streams as it comes.
"""

from __future__ import annotations

import re

from gateway.split_tags import tag_prefix_len

START = "<|start|>"
MESSAGE = "<|message|>"
CALL = "<|call|>"
_ENDS = ("<|end|>", CALL, "<|return|>", START)  # what ends a body
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FINAL_BODY = "<|channel|>final<|message|>"  # where the final answer's body starts
_FIRST_HEADER = 512 + len(MESSAGE) - 1  # a first header's longest text, its MESSAGE included


class HarmonySplit:
    """One output, read piece by piece (or whole, fed once as final)."""

    def __init__(self, keep_calls: bool = True) -> None:
        self._keep_calls = keep_calls  # False: calls are dropped (a request whose tools may not be called)
        self._text = ""  # what is not read yet: a header, or a body's tail that may begin a tag
        self._in_header = True
        self._kind = ""  # the open body's: "thought", "answer", "call" or "drop"
        self._messages = 0  # headers read
        self._said = {"thought": False, "answer": False}  # whether each has text yet
        self._new_body = False  # the open body has written nothing yet
        self._plain = False  # the output is not harmony: all answer
        self._call: list[str] = []  # the open call's text, held until its body ends

    def feed(self, text: str, final: bool, cut_short: bool = False) -> tuple[str, str]:
        """The thinking and the answer ``text`` adds (``final``: the output ends with it;
        ``cut_short``: it ends at its token limit, so a call still open is unfinished)."""
        if self._plain:
            return "", text
        self._text += text
        thought: list[str] = []
        answer: list[str] = []
        while True:
            if self._in_header:
                first = not self._messages
                at = self._text.find(MESSAGE, 0, _FIRST_HEADER) if first else self._text.find(MESSAGE)
                if at < 0:
                    if first and (final or len(self._text) >= _FIRST_HEADER):  # not harmony
                        self._plain = True
                        answer.append(self._text)
                        self._text = ""
                    elif final:  # a later header cut short is dropped
                        self._text = ""
                    break
                self._kind, recipient = _classify(self._text[:at])
                if self._kind == "call" and not self._keep_calls:
                    self._kind = "drop"
                if self._kind == "call":
                    self._call = [f"{START}{recipient}{MESSAGE}"]
                self._new_body = True
                self._text, self._in_header = self._text[at + len(MESSAGE) :], False
                self._messages += 1
                continue
            found = [(i, tag) for tag in _ENDS if (i := self._text.find(tag)) >= 0]
            end, tag = min(found) if found else (-1, "")
            if end < 0:
                keep = 0 if final else tag_prefix_len(self._text, *_ENDS)
                self._body(self._text[: len(self._text) - keep], thought, answer)
                self._text = self._text[len(self._text) - keep :]
                if final:
                    self._close(answer, finished=not cut_short)
                break
            self._body(self._text[:end], thought, answer)
            self._close(answer)
            self._text = self._text[end:] if tag == START else self._text[end + len(tag) :]
            self._in_header = True
        return "".join(thought), "".join(answer)

    def _body(self, text: str, thought: list[str], answer: list[str]) -> None:
        if not text or self._kind == "drop":
            return
        if self._kind == "call":
            self._call.append(text)
            return
        # Messages of the same kind are joined by a line, as vLLM joins them.
        if self._new_body and self._said[self._kind]:
            text = "\n" + text
        self._new_body, self._said[self._kind] = False, True
        (thought if self._kind == "thought" else answer).append(text)

    def _close(self, answer: list[str], finished: bool = True) -> None:
        if self._kind == "call" and finished:
            answer.extend((*self._call, CALL))
        self._kind, self._call = "", []


def split(text: str, keep_calls: bool = True, cut_short: bool = False) -> tuple[str | None, str | None]:
    """A whole output's thinking and answer (None where there is none; ``cut_short``: the output
    ends at its token limit)."""
    thought, answer = HarmonySplit(keep_calls).feed(text, final=True, cut_short=cut_short)
    return thought or None, answer or None


def _classify(header: str) -> tuple[str, str]:
    """A header's kind of body, and its recipient where it calls a function."""
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        name = recipient.group(1)
        return ("call", name) if name.startswith("functions.") and len(name) > len("functions.") else ("drop", "")
    channel = _CHANNEL.search(header)
    return ("thought", "") if channel is not None and channel.group(1) == "analysis" else ("answer", "")
