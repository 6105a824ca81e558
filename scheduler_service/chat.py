"""A conversation as a request's input, and its prompt tokens under the model's chat template.

The scheduler already holds the model's tokenizer, so it renders conversations itself, with
transformers' ``apply_chat_template`` (a sandboxed Jinja environment): a client then gets the prompt
the model was trained on, and usage counts the tokens the template produced.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from common.errors import FailedPrecondition, InvalidRequest
from common.pb import generate_pb2 as pb

# OpenAI's roles. A template may still refuse one it does not know (or an order it does not
# accept): that is INVALID_ARGUMENT too, with the template's own message.
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an assistant message; ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str

    def for_template(self) -> dict[str, Any]:
        """OpenAI's shape, the arguments parsed: templates index them as a mapping (vLLM parses them too)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": _json(self.arguments, "a tool call's arguments")},
        }


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    @property
    def chars(self) -> int:
        calls = sum(len(c.id) + len(c.name) + len(c.arguments) for c in self.tool_calls)
        return len(self.role) + len(self.content) + len(self.tool_call_id) + len(self.name) + calls

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.name:
            message["name"] = self.name
        return message


@dataclass(frozen=True)
class Chat:
    """A conversation to continue; raises InvalidRequest when malformed."""

    messages: tuple[ChatMessage, ...]
    # The request's own Jinja template, in place of the model's (where the server takes templates
    # from requests); empty: the model's.
    template: str = ""
    # End the prompt with the template's start of an assistant reply (what a chat client wants);
    # off, the prompt ends with the last message as the template renders it.
    add_generation_prompt: bool = True
    # End the prompt inside the last message, for the model to continue it.
    continue_final_message: bool = False
    # Extra variables for the template, and the JSON text they came as (it counts in ``chars``).
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    template_kwargs_json: str = ""
    # The tokenizer's special tokens on top of the template's (vLLM's chat add_special_tokens).
    add_special_tokens: bool = False
    # The tools the model may call (OpenAI's definitions, as JSON text); empty: none.
    tools_json: str = ""
    # Documents for retrieval-augmented generation (a JSON array of objects); empty: none.
    documents_json: str = ""

    def __post_init__(self) -> None:
        if not self.messages:
            raise InvalidRequest("chat has no messages; send at least one")
        for i, message in enumerate(self.messages):
            if message.role not in ROLES:
                raise InvalidRequest(f"chat message {i} has role {message.role!r}; use one of {', '.join(ROLES)}")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message continues the last message, add_generation_prompt starts a new one: "
                "set add_generation_prompt to false"
            )
        for what, value in (("tools", self.tools), ("documents", self.documents)):
            if value is not None and not (isinstance(value, list) and all(isinstance(t, dict) for t in value)):
                raise InvalidRequest(f"chat {what} must be a JSON array of objects")
        for message in self.messages:
            for call in message.tool_calls:
                call.for_template()  # its arguments parse, or the request is refused here

    @property
    def chars(self) -> int:
        """What counts against ``max_prompt_chars``: every message (role, content, tool calls), the
        template, its variables and the tools."""
        messages = sum(m.chars for m in self.messages)
        extras = len(self.template_kwargs_json) + len(self.tools_json) + len(self.documents_json)
        return len(self.template) + extras + messages

    @functools.cached_property
    def tools(self) -> Any:
        """The tools, parsed (None: none)."""
        return _json(self.tools_json, "chat tools") if self.tools_json else None

    @functools.cached_property
    def documents(self) -> Any:
        """The documents, parsed (None: none)."""
        return _json(self.documents_json, "chat documents") if self.documents_json else None

    @classmethod
    def from_pb(cls, msg: pb.Chat) -> Chat:
        return cls(
            messages=tuple(
                ChatMessage(
                    m.role,
                    m.content,
                    tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                    m.tool_call_id,
                    m.name,
                )
                for m in msg.messages
            ),
            template=msg.chat_template,
            add_generation_prompt=msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True,
            continue_final_message=msg.continue_final_message,
            template_kwargs=_template_kwargs(msg.chat_template_kwargs),
            template_kwargs_json=msg.chat_template_kwargs,
            add_special_tokens=msg.add_special_tokens,
            tools_json=msg.tools,
            documents_json=msg.documents,
        )


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidRequest(f"{what} must be JSON") from None


def _template_kwargs(text: str) -> dict[str, Any]:
    if not text:
        return {}
    kwargs = _json(text, "chat_template_kwargs")
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be a JSON object")
    return kwargs


def _reserved_names(tokenizer: Any) -> frozenset[str]:
    """The names ``apply_chat_template`` takes itself, and ``messages``, which it hands the template:
    a template variable may not reuse one."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD) | {"messages"}


def chat_prompt_ids(tokenizer: Any, chat: Chat, allow_request_template: bool) -> list[int]:
    """The prompt's token ids: ``chat`` rendered with the request's own template where it brings
    one and ``allow_request_template`` (as vLLM's ``--trust-request-chat-template``: in place of
    the model's), else with the model's; FailedPrecondition for a template the server does not take
    from requests, or for a model with none and no template of the request's."""
    template: str | None = None
    own = getattr(tokenizer, "chat_template", None) is not None
    if chat.template:
        if not allow_request_template:
            raise FailedPrecondition(
                "this server takes no chat template from requests (request_level.allow_request_chat_template "
                "is off): "
                + ("leave chat_template out to use the model's" if own else "send the prompt as text or token ids")
            )
        template = chat.template
    elif not own:
        raise FailedPrecondition(
            "the served model has no chat template: send the prompt as text or token ids"
            + (", or a chat_template with the conversation" if allow_request_template else "")
        )
    if chat.template_kwargs:  # a signature read per request only for those that bring variables
        taken = sorted(_reserved_names(tokenizer).intersection(chat.template_kwargs))
        if taken:
            raise InvalidRequest(f"chat_template_kwargs may not set {taken[0]!r}: the chat request decides it")
    messages = [m.for_template() for m in chat.messages]
    try:
        # Tokenised, the template's text takes no special tokens of the tokenizer's: with them it
        # is rendered as text and tokenised as a prompt.
        rendered = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            tools=chat.tools,
            documents=chat.documents,
            tokenize=not chat.add_special_tokens,
            return_dict=False,
            **chat.template_kwargs,
        )
        ids = tokenizer.encode(rendered, add_special_tokens=True) if chat.add_special_tokens else rendered
    except TemplateError as exc:  # a syntax error in a request's template, or the template's raise_exception
        raise InvalidRequest(f"the chat template refused the conversation: {exc}") from None
    except (ValueError, TypeError) as exc:  # continue_final_message on a message the template alters, say
        raise InvalidRequest(f"the chat could not be rendered: {exc}") from None
    return [int(t) for t in ids]
