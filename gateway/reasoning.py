"""Reasoning models' thinking, split from their answers: ``<think>...</think>`` before the answer,
as DeepSeek-R1, QwQ and Qwen3 write it (``[THINK]...[/THINK]`` for Mistral's Magistral), returned
in the message's ``reasoning_content`` (and ``reasoning``, the newer name) instead of
``content``, as vLLM's ``--reasoning-parser`` does.

The parsers (``baton gateway --reasoning-parser``) differ in their tags and where the output has
no end tag:

- ``deepseek_r1``: the model's template opens the thinking in the prompt, so an output is
  reasoning until ``</think>`` (an output without one is all reasoning, cut short); a leading
  ``<think>`` is dropped.
- ``qwen3``: Qwen3 and Qwen3.5, thinking unless the template variable ``enable_thinking`` is
  false (then all answer): as ``deepseek_r1`` (Qwen3.5's and the 2507 thinking models' templates
  open the thinking in the prompt; earlier ones let the model write ``<think>``), except that a
  call in Qwen3-Coder's form (``<tool_call>`` then ``<function=``) ends the thinking too, and
  begins the answer, as vLLM reads it.
- ``glm45``: GLM-4.5 to 4.7, whose output opens its thinking with ``<think>`` (their templates
  switch thinking off with ``enable_thinking``, closing it in the prompt): an output that does not
  open with the tag is all answer; one that does is reasoning until ``</think>`` (all of it, cut
  short, without one).
- ``mistral``: as ``glm45``, with Magistral's ``[THINK]`` and ``[/THINK]``. They are special
  tokens, whose text an output keeps only with ``skip_special_tokens`` false, so the parser asks
  for it unless the request says otherwise, as vLLM's does.
- ``deepseek_v3``: DeepSeek V3.1 and later, whose thinking is off unless the request's template
  variables switch it on (``thinking`` or ``enable_thinking``): then as ``deepseek_r1``, else the
  output is all answer.
- ``kimi_k2``: Kimi K2's thinking models, on unless the template variable ``thinking`` is false:
  as ``deepseek_r1``, except that the section of tool calls (``<|tool_calls_section_begin|>``)
  ends the thinking too, and begins the answer.
- ``openai_gptoss``: gpt-oss's harmony messages (``harmony``): the ``analysis`` channel is the
  thinking, the rest the answer, where its calls stay for the ``openai`` tool-call parser. Its
  tags are special tokens too. No one text marks where a harmony answer starts (the final
  message's header varies, and earlier turns' are in the prompt), so a structured output is
  refused with the reason rather than held to the wrong text.

A tag split across two messages is held back until it is whole. Tool calls (``openai_tools``) are
read from the answer alone. A structured output (``response_format``, a forced tool call) holds
the answer, not the thinking: its grammar waits for ``</think>`` (``StructuredOutput.starts_after``),
or holds from the start where the prompt already closed the thinking, as vLLM constrains it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from common.pb import generate_pb2 as pb
from gateway import harmony
from gateway.errors import BadRequest
from gateway.split_tags import tag_prefix_len

START = "<think>"
END = "</think>"


@dataclass(frozen=True)
class _Tags:
    start: str
    end: str
    # True: an output is thinking until the end tag (all of it without one); False: only an output
    # that opens with the start tag thinks (until the end tag), any other is all answer.
    opened_in_prompt: bool
    special: bool = False  # the tags are special tokens: their text must be kept
    harmony: bool = False  # messages with channels (gpt-oss), which ``harmony`` splits; ``end`` opens the answer
    # Whether the model thinks when the request's template variables do not say (None: always);
    # ``switch``: the variables that say (any of them true switches it on).
    thinks_by_default: bool | None = None
    switch: tuple[str, ...] = ()
    implicit_end: str = ""  # a text that ends the thinking and begins the answer (a section of calls)


_PARSERS = {
    "deepseek_r1": _Tags(START, END, opened_in_prompt=True),
    "qwen3": _Tags(
        START, END, True, thinks_by_default=True, switch=("enable_thinking",), implicit_end="<tool_call>\n<function="
    ),
    "glm45": _Tags(START, END, opened_in_prompt=False),
    "mistral": _Tags("[THINK]", "[/THINK]", opened_in_prompt=False, special=True),
    "openai_gptoss": _Tags("", harmony.FINAL_BODY, opened_in_prompt=False, special=True, harmony=True),
    "deepseek_v3": _Tags(START, END, True, thinks_by_default=False, switch=("thinking", "enable_thinking")),
    "kimi_k2": _Tags(
        START, END, True, thinks_by_default=True, switch=("thinking",), implicit_end="<|tool_calls_section_begin|>"
    ),
}
REASONING_PARSERS = tuple(_PARSERS)


@dataclass(frozen=True)
class Reasoning:
    """One of ``REASONING_PARSERS``."""

    parser: str
    thinking: bool = True  # False: this request's template variables switched the thinking off

    def __post_init__(self) -> None:
        if self.parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.parser!r}; choose one of {', '.join(REASONING_PARSERS)}")

    @property
    def tags(self) -> _Tags:
        return _PARSERS[self.parser]

    def for_request(self, variables: Mapping[str, Any]) -> Reasoning:
        """This parser as one request's chat template variables set it: a model whose thinking they
        switch off (``thinking: false``) writes none, and its whole output is the answer."""
        tags = self.tags
        if tags.thinks_by_default is None:
            return self
        said = [variables[key] for key in tags.switch if key in variables]
        return replace(self, thinking=any(bool(v) for v in said) if said else tags.thinks_by_default)

    def prepare(self, params: pb.SamplingParams) -> None:
        """A request's ``params`` as its output's split needs them: a structured output constrains
        the answer, its grammar waiting for the end of the thinking, and tags that are special
        tokens are kept in the text, where they are split."""
        if self.tags.harmony and params.HasField("structured_output"):
            # Its final message's header varies (``<|constrain|>`` may sit in it) and an earlier
            # turn's final header is in the prompt: no one text marks where the answer starts.
            raise BadRequest(
                "structured output (response_format, structured_outputs, or a named or required tool_choice "
                "without --tool-call-parser openai) is not served with the openai_gptoss reasoning parser: "
                "gpt-oss's harmony messages give no one text after which to constrain its answer"
            )
        if params.HasField("structured_output") and self.thinking:
            params.structured_output.starts_after = self.tags.end
            params.structured_output.reopened_by = self.tags.start
        if self.tags.special and not params.HasField("skip_special_tokens"):
            params.skip_special_tokens = False

    def split(self, text: str, keep_calls: bool = True, cut_short: bool = False) -> tuple[str | None, str | None]:
        """A whole output's reasoning and answer (None where there is none); ``keep_calls`` False
        drops the calls a harmony output makes (its request's tools may not be called), and
        ``cut_short`` (the output ends at its token limit) the one it was still writing."""
        tags = self.tags
        if tags.harmony:
            return harmony.split(text, keep_calls, cut_short)
        if not self.thinking or (not tags.opened_in_prompt and not text.startswith(tags.start)):
            return None, text or None  # it did not think (a stream reads such an output so too)
        implicit = text.find(tags.implicit_end) if tags.implicit_end else -1
        if implicit >= 0 and (tags.end not in text or implicit < text.find(tags.end)):
            return self._after_start(text[:implicit]) or None, text[implicit:]
        if tags.end not in text:  # cut short: all thinking
            return self._after_start(text) or None, None
        reasoning, _, answer = text.partition(tags.end)
        return self._after_start(reasoning) or None, answer or None

    def _after_start(self, text: str) -> str:
        start = self.tags.start
        return text[len(start) :] if text.startswith(start) else text


class ReasoningStream:
    """One streamed output, read message by message."""

    def __init__(self, reasoning: Reasoning, keep_calls: bool = True) -> None:
        self.reasoning = reasoning
        self._pending = ""  # text held back: the start of the output, or a possible start of a tag
        self._state = "start"  # "start" (before the output shows whether it thinks), "thinking", "answer"
        self._harmony = harmony.HarmonySplit(keep_calls) if reasoning.tags.harmony else None

    def feed(self, text: str, final: bool, cut_short: bool = False) -> tuple[str, str]:
        """The reasoning and the answer that ``text`` adds (``final``: the output ends with it;
        ``cut_short``: at its token limit)."""
        if self._harmony is not None:
            return self._harmony.feed(text, final, cut_short)
        if not self.reasoning.thinking:
            return "", text
        self._pending += text
        thought = answered = ""
        tags = self.reasoning.tags
        if self._state == "start":
            if tags.start.startswith(self._pending) and not final:
                return "", ""  # it may yet open with the tag
            if self._pending.startswith(tags.start):
                self._pending = self._pending[len(tags.start) :]
                self._state = "thinking"
            else:
                self._state = "thinking" if tags.opened_in_prompt else "answer"
        if self._state == "thinking":
            ends = [(at, tag) for tag in (tags.end, tags.implicit_end) if tag and (at := self._pending.find(tag)) >= 0]
            if not ends:
                keep = 0 if final else tag_prefix_len(self._pending, tags.end, tags.implicit_end)
                thought = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                return thought, ""
            end, tag = min(ends)
            thought = self._pending[:end]
            # The end tag is dropped; a section of calls that ends the thinking is the answer's start.
            self._pending = self._pending[end + len(tag) :] if tag == tags.end else self._pending[end:]
            self._state = "answer"
        answered, self._pending = self._pending, ""
        return thought, answered
