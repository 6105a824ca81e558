"""OpenAI's Responses API (``POST /v1/responses``), as a translation of the chat route.

A Responses request is a chat in other words: its ``instructions`` are a system message, its
``input`` the conversation (a string, or items: messages, earlier ``function_call`` items and their
``function_call_output`` results), its function tools and ``tool_choice`` the chat's in a flatter
shape, ``text.format`` the chat's ``response_format``, ``reasoning.effort`` its
``reasoning_effort``, ``max_output_tokens`` its ``max_tokens``. ``chat_body`` rewrites it so, and
the chat route serves it, tool calling, reasoning and structured output included, exactly as a
chat request; the answer is rewritten back: a whole chat completion into a response object
(``response_of``), a chat stream's chunks into the Responses API's typed events
(``ResponseEvents``). As in vLLM: a reasoning model's thinking is a ``reasoning`` item, each call a
``function_call`` item, the text a ``message`` item.

Baton keeps no responses: ``previous_response_id``, ``conversation``, ``background`` and stored
prompts are a 400 (send the whole conversation as ``input``), and the response says
``"store": false``. Built-in tools (web search, files, computer use), ``include`` and
``top_logprobs`` are a 400 too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequest, GatewayError
from gateway.output_blocks import CALL, REASONING, TEXT, Block, BlockEvent, OutputBlocks

# Chat fields a Responses request may carry as they are: vLLM's sampling extensions among them.
_PASSED = (
    "model",
    "stream",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "include_reasoning",
    "chat_template_kwargs",
    "cache_salt",
    "request_id",
    "min_tokens",
    "stop_token_ids",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "structured_outputs",
)
# Fields that need what Baton does not keep or run, and why they are refused.
_STATELESS = "this server keeps no responses: send the whole conversation as input"
_REFUSED = {
    "previous_response_id": _STATELESS,
    "conversation": _STATELESS,
    "prompt": "this server keeps no prompts",
    "background": "this server runs no responses in the background",
    "include": "this server adds nothing to a response on request",
    "top_logprobs": "log probabilities are served on the chat and completions routes",
}
_ROLES = {"developer": "system"}  # as chat templates know them
_STATUS = {"length": "incomplete", "abort": "cancelled"}  # else "completed"
# The stream's last event for each final status: the API has none of its own for a cancelled one.
_LAST_EVENT = {"incomplete": "response.incomplete", "failed": "response.failed"}


# The chat request's fields and what a Responses request calls them, for errors: a client is
# told of the fields it sent.
_FIELD_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
_CHAT_FIELD = re.compile(r"\b(" + "|".join(_FIELD_NAMES) + r")\b")


def responses_error(error: GatewayError) -> GatewayError:
    """``error`` of the chat request a Responses request amounts to, in the Responses request's
    words: the fields it names are the ones the client sent."""
    message = _CHAT_FIELD.sub(lambda m: _FIELD_NAMES[m.group(1)], error.message)
    param = _FIELD_NAMES.get(error.param, error.param) if error.param is not None else None
    return GatewayError(error.status, message, error.code, param, error.headers, error.error_type)


@dataclass(frozen=True)
class ResponseEcho:
    """What a response object repeats of its request (its settings, tools, metadata)."""

    fields: Mapping[str, Any]


def chat_body(body: Mapping[str, Any]) -> tuple[dict[str, Any], ResponseEcho]:
    """The chat request a Responses request asks for, and what its response repeats of it."""
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False, [], 0, ""):
            raise BadRequest(f"{name} is not supported: {why}", param=name)
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequest('truncation must be "disabled"', param="truncation")
    chat: dict[str, Any] = {name: body[name] for name in _PASSED if name in body}
    chat["messages"] = _messages(body.get("instructions"), body.get("input"))
    if (limit := body.get("max_output_tokens")) is not None:
        chat["max_completion_tokens"] = limit
    tools = body.get("tools")
    if tools:
        chat["tools"] = [_chat_tool(tool) for tool in _list(tools, "tools")]
    if (choice := body.get("tool_choice")) is not None:
        chat["tool_choice"] = _chat_tool_choice(choice)
    text = body.get("text")
    if text is not None and (shape := _response_format(text)) is not None:
        chat["response_format"] = shape
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise BadRequest("reasoning must be an object", param="reasoning")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # the final event carries the usage
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest("metadata must be an object", param="metadata")
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": reasoning or {"effort": None, "summary": None},
        "store": False,
        "temperature": body.get("temperature"),
        "text": text or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": tools or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return chat, ResponseEcho(echo)


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list", param=name)
    return value


def _messages(instructions: Any, items: Any) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for item in _list(items, "input"):
        if not isinstance(item, dict):
            raise BadRequest("each input item must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise BadRequest("an input message needs a role", param="input")
            messages.append({"role": _ROLES.get(role, role), "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last and not last["content"]:
                last["tool_calls"].append(call)  # the calls of one turn are one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            # A string, or content parts (their text, as a message's); anything else as its JSON.
            content = _text(output) if isinstance(output, str | list) else json.dumps(output, ensure_ascii=False)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind != "reasoning":  # earlier thinking is not sent back to the model, as in vLLM
            raise BadRequest(f"input items of type {kind!r} are not supported", param="input")
    if not messages:
        raise BadRequest("input must not be empty", param="input")
    return messages


def _text(content: Any) -> str:
    """An input message's text: a string, or text parts joined by newlines (as chat's parts)."""
    if isinstance(content, str):
        return content
    parts = []
    for part in _list(content, "input"):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise BadRequest("only text content parts are supported", param="input")
        parts.append(part["text"])
    return "\n".join(parts)


def _chat_tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise BadRequest(f"only function tools are supported, not {kind!r}", param="tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "auto", "none", "required", or what the chat route refuses


def _response_format(text: Any) -> dict[str, Any] | None:
    """The chat response_format of ``text``'s format; None where it names none (every field of
    ``text`` is optional: ``verbosity`` alone, say)."""
    if not isinstance(text, dict):
        raise BadRequest("text must be an object", param="text")
    shape = text.get("format")
    if shape is None:
        return None
    if not isinstance(shape, dict):
        raise BadRequest("text.format must be an object", param="text")
    if shape.get("type") == "json_schema":
        schema = {key: shape[key] for key in ("name", "schema", "strict", "description") if key in shape}
        return {"type": "json_schema", "json_schema": schema}
    return shape  # text, json_object, or what the chat route refuses


def response_of(completion: Mapping[str, Any], echo: ResponseEcho) -> dict[str, Any]:
    """The response object of a whole chat completion."""
    (choice,) = completion["choices"]
    message = choice["message"]
    rid = completion["id"].removeprefix("chatcmpl-")
    output: list[dict[str, Any]] = []
    if message.get("reasoning"):
        output.append(_reasoning_item(rid, message["reasoning"]))
    if message.get("content"):
        output.append(_message_item(rid, message["content"]))
    output += [
        _call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
        for call in message.get("tool_calls") or []
    ]
    return _response(rid, completion, choice["finish_reason"], output, completion.get("usage"), echo)


def _response(
    rid: str,
    head: Mapping[str, Any],
    finish_reason: str | None,  # None: still running
    output: list[dict[str, Any]],
    usage: Mapping[str, Any] | None,
    echo: ResponseEcho,
) -> dict[str, Any]:
    status = "in_progress" if finish_reason is None else _STATUS.get(finish_reason, "completed")
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": head["created"],
        "model": head["model"],
        "status": status,
        "error": None,
        # A length finish is max_output_tokens' or, where none was set, the context's end.
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output,
        "usage": _usage(usage) if usage else None,
        **echo.fields,
    }


def _usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
        "output_tokens": usage["completion_tokens"],
        # Required by the API; the chat usage does not count the thinking apart.
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _message_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [_reasoning_part(text)] if status == "completed" else []
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [], "content": content, "status": status}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponseEvents:
    """The Responses API's stream events of one chat stream, chunk by chunk: each output item
    (thinking, text, each call: ``output_blocks``) opens, grows by deltas and closes in turn, and
    the last event holds the whole response."""

    def __init__(self, echo: ResponseEcho) -> None:
        self._echo = echo
        self._blocks = OutputBlocks()
        self._sequence = 0
        self._rid = ""
        self._output: list[dict[str, Any]] = []  # the closed items
        self._error: Mapping[str, Any] | None = None  # what ended the stream, if it failed

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk (or a gateway error body) makes."""
        if "error" in chunk:
            error = self._error = chunk["error"]
            return [self._event("error", code=error.get("code"), message=error["message"], param=error.get("param"))]
        events = []
        if not self._blocks.started:
            self._rid = chunk["id"].removeprefix("chatcmpl-")
            self._blocks.head = chunk  # the response's id, time and model, before any block
            started = self._snapshot(final=False)
            events.append(self._event("response.created", response=started))
            events.append(self._event("response.in_progress", response=started))
        for change in self._blocks.feed(chunk):
            events += self._events_of(change)
        return events

    def end(self) -> list[dict[str, Any]]:
        """The closing events, once the chat stream has ended."""
        if not self._blocks.started:
            return []
        events = [event for change in self._blocks.end() for event in self._events_of(change)]
        response = self._snapshot(final=True)
        if self._error is not None:
            response.update(status="failed", error={"code": self._error.get("code"), "message": self._error["message"]})
        return [*events, self._event(_LAST_EVENT.get(response["status"], "response.completed"), response=response)]

    def _snapshot(self, final: bool) -> dict[str, Any]:
        blocks = self._blocks
        finish = (blocks.finish_reason or "stop") if final else None
        return _response(self._rid, blocks.head, finish, list(self._output), blocks.usage, self._echo)

    def _events_of(self, change: BlockEvent) -> list[dict[str, Any]]:
        block = change.block
        item_id = self._item(block, "in_progress")["id"]
        at = {"item_id": item_id, "output_index": block.index}
        if change.what == "open":
            events = [
                self._event(
                    "response.output_item.added", output_index=block.index, item=self._item(block, "in_progress")
                )
            ]
            if block.kind == TEXT:
                events.append(self._event("response.content_part.added", **at, content_index=0, part=_text_part("")))
            elif block.kind == REASONING:  # vLLM's event: the API's content_part events are for text
                part = _reasoning_part("")
                events.append(self._event("response.reasoning_part.added", **at, content_index=0, part=part))
            return events
        if change.what == "delta":
            if block.kind == CALL:
                return [self._event("response.function_call_arguments.delta", **at, delta=change.delta)]
            if block.kind == REASONING:
                return [self._event("response.reasoning_text.delta", **at, content_index=0, delta=change.delta)]
            return [self._event("response.output_text.delta", **at, content_index=0, delta=change.delta, logprobs=[])]
        if block.kind == CALL:
            events = [self._event("response.function_call_arguments.done", **at, name=block.name, arguments=block.text)]
        elif block.kind == REASONING:
            events = [
                self._event("response.reasoning_text.done", **at, content_index=0, text=block.text),
                self._event("response.reasoning_part.done", **at, content_index=0, part=_reasoning_part(block.text)),
            ]
        else:
            events = [
                self._event("response.output_text.done", **at, content_index=0, text=block.text, logprobs=[]),
                self._event("response.content_part.done", **at, content_index=0, part=_text_part(block.text)),
            ]
        done = self._item(block, "completed")
        self._output.append(done)
        return [*events, self._event("response.output_item.done", output_index=block.index, item=done)]

    def _item(self, block: Block, status: str) -> dict[str, Any]:
        text = block.text if status == "completed" else ""
        if block.kind == CALL:
            return _call_item(block.call_id, block.name, text, status)
        if block.kind == REASONING:
            return _reasoning_item(self._rid, text, status)
        return _message_item(self._rid, text, status)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
