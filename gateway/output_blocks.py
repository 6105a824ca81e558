"""A streamed chat answer as a sequence of blocks: its thinking, its text, each tool call.

APIs other than chat completions (OpenAI's Responses API, Anthropic's Messages API) stream an
answer as parts that each open, grow and close in turn, where chat completions streams deltas of
several fields at once. ``OutputBlocks`` reads a chat stream's chunks (as ``gateway.app`` makes
them, one choice) and says when each block opens, what it grows by, and when it closes, with the
stream's finish reason, stop reason and usage; each API's encoder turns that into its own events.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

REASONING = "reasoning"
TEXT = "text"
CALL = "call"


@dataclass
class Block:
    """One part of the answer: ``kind`` is REASONING, TEXT or CALL (with the call's id and name);
    ``text`` is its text, or a call's arguments, so far."""

    kind: str
    index: int  # its place among the answer's blocks
    call_id: str = ""
    name: str = ""
    text: str = ""


@dataclass(frozen=True)
class BlockEvent:
    """A block opened (``delta`` empty), grew by ``delta``, or closed (its ``text`` whole)."""

    what: str  # "open", "delta" or "close"
    block: Block
    delta: str = ""


@dataclass
class OutputBlocks:
    """One chat stream's chunks, read as blocks."""

    head: Mapping[str, Any] = field(default_factory=dict)  # the first chunk: id, created, model
    blocks: list[Block] = field(default_factory=list)  # every block so far, the last maybe open
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Mapping[str, Any] | None = None
    _open: Block | None = None
    _call_index: int = -1  # the chat delta index of the open call

    @property
    def started(self) -> bool:
        return bool(self.head)

    def feed(self, chunk: Mapping[str, Any]) -> list[BlockEvent]:
        """What one chat chunk opens, grows and closes."""
        if not self.head:
            self.head = chunk
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[BlockEvent] = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta", {})
            if delta.get("reasoning"):
                events += self._grow(REASONING, delta["reasoning"])
            if delta.get("content"):
                events += self._grow(TEXT, delta["content"])
            for call in delta.get("tool_calls", ()):
                events += self._grow_call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
        return events

    def end(self) -> list[BlockEvent]:
        """The open block's close, once the stream has ended."""
        return self._close()

    def _grow(self, kind: str, text: str) -> list[BlockEvent]:
        events = (
            [] if self._open is not None and self._open.kind == kind else self._start(Block(kind, len(self.blocks)))
        )
        block = self.blocks[-1]
        block.text += text
        return [*events, BlockEvent("delta", block, text)]

    def _grow_call(self, call: Mapping[str, Any]) -> list[BlockEvent]:
        function = call.get("function", {})
        events = []
        if self._open is None or self._open.kind != CALL or call.get("index", 0) != self._call_index:
            self._call_index = call.get("index", 0)
            block = Block(CALL, len(self.blocks), call.get("id", ""), function.get("name", ""))
            events += self._start(block)
        arguments = function.get("arguments", "")
        if arguments:
            self.blocks[-1].text += arguments
            events.append(BlockEvent("delta", self.blocks[-1], arguments))
        return events

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self._close()
        self.blocks.append(block)
        self._open = block
        return [*events, BlockEvent("open", block)]

    def _close(self) -> list[BlockEvent]:
        block, self._open = self._open, None
        return [] if block is None else [BlockEvent("close", block)]
