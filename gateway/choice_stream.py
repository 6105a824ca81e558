"""One streamed choice's chunks, message by message: its echo and log probabilities
(``openai_logprobs``), its thinking split from its answer (``reasoning``), its tool calls
(``openai_tools``), its token ids and its usage so far, in OpenAI's and vLLM's chunk shapes."""

from __future__ import annotations

from typing import Any

from common.pb import generate_pb2 as pb
from gateway.openai_logprobs import ChoiceLogprobs
from gateway.openai_tools import AUTO, ToolCallStream
from gateway.openai_types import FINISH_REASON, Reply
from gateway.reasoning import ReasoningStream


class ChoiceStream:
    """Choice ``index`` of ``reply``'s stream."""

    def __init__(self, reply: Reply, index: int, shape: ChoiceLogprobs) -> None:
        self.reply, self.index = reply, index
        self._shape = shape
        tools = reply.tools
        self._tools = ToolCallStream(tools) if tools is not None and tools.shapes_answer else None
        self._thinking = (
            ReasoningStream(reply.reasoning, keep_calls=tools is not None and tools.mode == AUTO)
            if reply.reasoning is not None
            else None
        )

    def chunks(self, message: pb.GenerateResponse, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The chunks one of Baton's messages for this choice makes (none where its text is held back
        and it brings nothing else); ``usage``: the usage so far, under ``continuous_usage_stats``."""
        reply, index, reason = self.reply, self.index, message.finish_reason
        text, logprobs = self._shape.shape(message)
        out = []
        if self._thinking is not None:
            thought, text = self._thinking.feed(text, final=bool(reason), cut_short=reason == pb.FINISH_REASON_LENGTH)
            if thought and reply.include_reasoning:
                out.append(reply.chunk(None, index=index, usage=usage, reasoning=thought))
        # A message's tokens go out even where their text is held back: their logprobs and ids.
        carries = bool(message.logprobs) or reply.token_ids
        if self._tools is not None:
            delta, finish, content = self._tools.feed(text, FINISH_REASON.get(reason) if reason else None)
            if delta or content or carries:
                out.append(
                    reply.chunk(
                        content or None, index=index, logprobs=logprobs, tool_calls=delta, usage=usage, ids=message
                    )
                )
            if reason:
                out.append(reply.chunk(None, reason, index=index, finish=finish, usage=usage, stopped_by=message))
        elif reply.chat:
            if text or carries:
                out.append(reply.chunk(text, index=index, logprobs=logprobs, usage=usage, ids=message))
            if reason:
                out.append(reply.chunk(None, reason, index=index, usage=usage, stopped_by=message))
        elif text or reason or carries:
            out.append(
                reply.chunk(text, reason, index=index, logprobs=logprobs, usage=usage, ids=message, stopped_by=message)
            )
        return out
