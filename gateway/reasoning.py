"""Reasoning models' thinking, split from their answers: ``<think>...</think>`` before the answer,
as DeepSeek-R1, QwQ and Qwen3 write it, returned in the message's ``reasoning_content`` (and
``reasoning``, the newer name) instead of ``content``, as vLLM's ``--reasoning-parser`` does.

Two parsers (``baton gateway --reasoning-parser``), differing where the output has no end tag:

- ``deepseek_r1``: the model's template opens the thinking in the prompt, so an output is
  reasoning until ``</think>`` (an output without one is all reasoning, cut short); a leading
  ``<think>`` is dropped.
- ``qwen3``: thinking can be switched off (``chat_template_kwargs: {"enable_thinking": false}``),
  so an output without ``</think>`` is all answer. Streamed, an output is reasoning until
  ``</think>`` only if it opens with ``<think>``.

A tag split across two messages is held back until it is whole. Tool calls (``openai_tools``) are
read from the answer alone. A structured output (``response_format``, a forced tool call) holds
the answer, not the thinking: its grammar waits for ``</think>`` (``StructuredOutput.starts_after``),
or holds from the start where the prompt already closed the thinking, as vLLM constrains it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.pb import generate_pb2 as pb
from gateway.split_tags import tag_prefix_len

START = "<think>"
END = "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class Reasoning:
    """One of ``REASONING_PARSERS``."""

    parser: str

    def __post_init__(self) -> None:
        if self.parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.parser!r}; choose one of {', '.join(REASONING_PARSERS)}")

    def hold_off_constraint(self, params: pb.SamplingParams) -> None:
        """A structured output of ``params`` constrains the answer: its grammar waits for the end
        of the thinking."""
        if params.HasField("structured_output"):
            params.structured_output.starts_after = END

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's reasoning and answer (None where there is none)."""
        if END not in text:
            if self.parser == "qwen3":
                return None, text
            return _after_start(text) or None, None
        reasoning, _, answer = text.partition(END)
        return _after_start(reasoning) or None, answer or None


def _after_start(text: str) -> str:
    return text[len(START) :] if text.startswith(START) else text


class ReasoningStream:
    """One streamed output, read message by message."""

    def __init__(self, reasoning: Reasoning) -> None:
        self.reasoning = reasoning
        self._pending = ""  # text held back: the start of the output, or a possible start of a tag
        self._state = "start"  # "start" (before the output shows whether it thinks), "thinking", "answer"

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning and the answer that ``text`` adds (``final``: the output ends with it)."""
        self._pending += text
        thought = answered = ""
        if self._state == "start":
            if START.startswith(self._pending) and not final:
                return "", ""  # it may yet open with the tag
            if self._pending.startswith(START):
                self._pending = self._pending[len(START) :]
                self._state = "thinking"
            else:
                self._state = "thinking" if self.reasoning.parser == "deepseek_r1" else "answer"
        if self._state == "thinking":
            end = self._pending.find(END)
            if end < 0:
                keep = 0 if final else tag_prefix_len(self._pending, END)
                thought = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                return thought, ""
            thought = self._pending[:end]
            self._pending = self._pending[end + len(END) :]
            self._state = "answer"
        answered, self._pending = self._pending, ""
        return thought, answered
