"""Anthropic's Messages API (``POST /v1/messages``), as a translation of the chat route, as vLLM
serves it for Anthropic's clients.

A Messages request is a chat in other words: its ``system`` is a system message, its messages'
content blocks are text, earlier ``tool_use`` calls (an assistant message's tool calls) and
``tool_result`` answers (tool messages), its tools (``name``, ``description``, ``input_schema``)
and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``) the chat's, ``stop_sequences`` its
stop strings, ``thinking`` its template's ``enable_thinking`` and ``thinking``. ``chat_body`` rewrites it so; the
chat route serves it; ``message_of`` and ``MessageEvents`` rewrite the answer back: content blocks
(``thinking``, ``text``, ``tool_use``), a ``stop_reason`` (``end_turn``, ``max_tokens``,
``stop_sequence`` with the sequence that matched, ``tool_use``), and the usage with the prompt
tokens read from the prefix cache as ``cache_read_input_tokens``; streamed, Anthropic's events from
``message_start`` to ``message_stop``. Errors take Anthropic's shape (``error_body``).
``count_body`` is the ``/tokenize`` request of ``/v1/messages/count_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.errors import BadRequest, GatewayError
from gateway.output_blocks import CALL, REASONING, Block, BlockEvent, OutputBlocks

# Anthropic's error types by HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_PASSED = ("model", "stream", "temperature", "top_p", "top_k")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def error_body(error: GatewayError) -> dict[str, Any]:
    """An error as Anthropic's APIs answer one."""
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request a Messages request asks for."""
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise BadRequest("max_tokens is required", param="max_tokens")
    chat = _conversation(body)
    chat.update({name: body[name] for name in _PASSED if name in body})
    chat["max_tokens"] = max_tokens
    stops = body.get("stop_sequences")
    if stops:
        chat["stop"] = stops
    user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    if user is not None:
        chat["user"] = user
    choice = body.get("tool_choice")
    if choice is not None:
        chat.update(_chat_tool_choice(choice))
    if chat.get("stream"):
        # message_delta carries the output's usage; every chunk's usage (continuous), so that
        # message_start, made from the first, says the input's tokens as Anthropic's does.
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


def count_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """What ``/tokenize`` renders for a ``count_tokens`` request: the prompt a Messages request
    with its model, system, messages, tools and thinking would have."""
    return {"model": body.get("model", ""), **_conversation(body)}


def _conversation(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat fields that make a Messages request's prompt: messages, tools, template variables."""
    chat: dict[str, Any] = {"messages": _system(body.get("system")) + _messages(body.get("messages"))}
    last = chat["messages"][-1]
    if last["role"] == "assistant" and not last.get("tool_calls"):
        # A prefilled answer: the model continues it, as Anthropic's API does, rather than start a turn.
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    tools = body.get("tools")
    if tools:
        chat["tools"] = [_chat_tool(tool) for tool in _list(tools, "tools")]
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise BadRequest('thinking must be {"type": "enabled"} or {"type": "disabled"}', param="thinking")
        thinks = kind != "disabled"  # told by both names templates read (as reasoning_effort tells them)
        chat["chat_template_kwargs"] = {"enable_thinking": thinks, "thinking": thinks}
    return chat


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list", param=name)
    return value


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    return [{"role": "system", "content": system if isinstance(system, str) else _text(system, "system")}]


def _text(blocks: Any, param: str) -> str:
    """Text blocks' text, joined by newlines (as chat joins text parts)."""
    parts = []
    for block in _list(blocks, param):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise BadRequest("only text content blocks are supported here", param=param)
        parts.append(block["text"])
    return "\n".join(parts)


def _messages(messages: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in _list(messages, "messages"):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise BadRequest('each message needs the role "user" or "assistant"', param="messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in _list(content, "messages"):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and message["role"] == "assistant":
                arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
                calls.append(
                    {
                        "id": block.get("id"),
                        "type": "function",
                        "function": {"name": block.get("name"), "arguments": arguments},
                    }
                )
            elif kind == "tool_result" and message["role"] == "user":
                result = block.get("content", "")
                text = result if isinstance(result, str) else _text(result, "messages")
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            elif kind not in ("thinking", "redacted_thinking"):  # earlier thinking is not sent back
                raise BadRequest(f"content blocks of type {kind!r} are not supported", param="messages")
        if texts or calls:
            turn: dict[str, Any] = {"role": message["role"], "content": "\n".join(texts) or None}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    if not out:
        raise BadRequest("messages must not be empty", param="messages")
    return out


def _chat_tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "name" not in tool:
        raise BadRequest("only client tools (name, description, input_schema) are supported", param="tools")
    function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object", "properties": {}})}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    out: dict[str, Any] = {}
    if kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif kind in _TOOL_CHOICES:
        out["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        raise BadRequest('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}', param="tool_choice")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _stop(finish_reason: str | None, stop_reason: Any, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat finish; ``called``: the answer holds a
    tool call (a forced one too, whose chat finish is "stop"), which a client's loop runs on
    "tool_use". A request cancelled on the server has none, as vLLM answers an aborted one: it did
    not end its turn."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "abort":
        return None, None
    if finish_reason == "tool_calls" or called:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """Anthropic counts the prompt tokens read from a cache apart from the rest."""
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage.get("prompt_tokens", 0) - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.get("completion_tokens", 0),
    }


def _content_block(block: Block, whole: bool = True) -> dict[str, Any]:
    if block.kind == CALL:
        return {
            "type": "tool_use",
            "id": block.call_id,
            "name": block.name,
            "input": _input(block.text) if whole else {},
        }
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
    return {"type": "text", "text": block.text if whole else ""}


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:  # a call cut short: its arguments as they stand
        return {"arguments": arguments}


def _message(
    head: Mapping[str, Any], content: list[dict[str, Any]], stop: tuple[str | None, str | None]
) -> dict[str, Any]:
    return {
        "id": "msg_" + str(head["id"]).removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": head["model"],
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
    }


def message_of(completion: Mapping[str, Any]) -> dict[str, Any]:
    """The message of a whole chat completion."""
    (choice,) = completion["choices"]
    chat = choice["message"]
    content = []
    if chat.get("reasoning"):
        content.append(_content_block(Block(REASONING, 0, text=chat["reasoning"])))
    if chat.get("content"):
        content.append({"type": "text", "text": chat["content"]})
    for call in chat.get("tool_calls") or []:
        content.append(
            _content_block(Block(CALL, 0, call["id"], call["function"]["name"], call["function"]["arguments"]))
        )
    called = bool(chat.get("tool_calls"))
    message = _message(completion, content, _stop(choice["finish_reason"], choice.get("stop_reason"), called))
    message["usage"] = _usage(completion.get("usage"))
    return message


class MessageEvents:
    """Anthropic's stream events of one chat stream, chunk by chunk."""

    def __init__(self) -> None:
        self._blocks = OutputBlocks()
        self._failed = False
        self._called = False  # a tool_use block was opened

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk (or a gateway error body) makes."""
        if "error" in chunk:
            self._failed = True
            error = chunk["error"]
            return [{"type": "error", "error": {"type": "api_error", "message": error["message"]}}]
        events = []
        if not self._blocks.started:
            self._blocks.head = chunk
            start = _message(chunk, [], (None, None))
            start["usage"] = _usage(chunk.get("usage"))
            events.append({"type": "message_start", "message": start})
        for change in self._blocks.feed(chunk):
            events += self._events_of(change)
        return events

    def end(self) -> list[dict[str, Any]]:
        """The closing events, once the chat stream has ended."""
        if not self._blocks.started or self._failed:
            return []
        blocks = self._blocks
        events = [event for change in blocks.end() for event in self._events_of(change)]
        reason, sequence = _stop(blocks.finish_reason, blocks.stop_reason, self._called)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        events.append({"type": "message_delta", "delta": delta, "usage": _usage(blocks.usage)})
        return [*events, {"type": "message_stop"}]

    def _events_of(self, change: BlockEvent) -> list[dict[str, Any]]:
        block = change.block
        if change.what == "open":
            self._called |= block.kind == CALL
            return [
                {"type": "content_block_start", "index": block.index, "content_block": _content_block(block, False)}
            ]
        if change.what == "close":
            return [{"type": "content_block_stop", "index": block.index}]
        if block.kind == CALL:
            delta = {"type": "input_json_delta", "partial_json": change.delta}
        elif block.kind == REASONING:
            delta = {"type": "thinking_delta", "thinking": change.delta}
        else:
            delta = {"type": "text_delta", "text": change.delta}
        return [{"type": "content_block_delta", "index": block.index, "delta": delta}]
