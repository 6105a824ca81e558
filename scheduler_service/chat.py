"""A conversation as a request's input, and its prompt tokens under the model's chat template.

The scheduler already holds the model's tokenizer, so it renders conversations itself, with
transformers' ``apply_chat_template`` (a sandboxed Jinja environment): a client then gets the prompt
the model was trained on, and usage counts the tokens the template produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from common.errors import FailedPrecondition, InvalidRequest
from common.pb import generate_pb2 as pb

# OpenAI's roles. A template may still refuse one it does not know (or an order it does not
# accept): that is INVALID_ARGUMENT too, with the template's own message.
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str


@dataclass(frozen=True)
class Chat:
    """A conversation to continue; raises InvalidRequest when malformed."""

    messages: tuple[ChatMessage, ...]
    # The request's own Jinja template, for a model that has none; empty: none.
    template: str = ""
    # End the prompt with the template's start of an assistant reply (what a chat client wants);
    # off, the prompt ends with the last message as the template renders it.
    add_generation_prompt: bool = True

    def __post_init__(self) -> None:
        if not self.messages:
            raise InvalidRequest("chat has no messages; send at least one")
        for i, message in enumerate(self.messages):
            if message.role not in ROLES:
                raise InvalidRequest(f"chat message {i} has role {message.role!r}; use one of {', '.join(ROLES)}")

    @property
    def chars(self) -> int:
        """What counts against ``max_prompt_chars``: every role and content, and the template."""
        return len(self.template) + sum(len(m.role) + len(m.content) for m in self.messages)

    @classmethod
    def from_pb(cls, msg: pb.Chat) -> Chat:
        return cls(
            messages=tuple(ChatMessage(m.role, m.content) for m in msg.messages),
            template=msg.chat_template,
            add_generation_prompt=msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True,
        )


def chat_prompt_ids(tokenizer: Any, chat: Chat, allow_request_template: bool) -> list[int]:
    """The prompt's token ids: ``chat`` rendered with the model's template, or, for a model with
    none, the request's own when ``allow_request_template``; else FailedPrecondition."""
    template: str | None = None
    if getattr(tokenizer, "chat_template", None) is None:
        if not chat.template:
            raise FailedPrecondition(
                "the served model has no chat template: send the prompt as text or token ids"
                + (", or a chat_template with the conversation" if allow_request_template else "")
            )
        if not allow_request_template:
            raise FailedPrecondition(
                "the served model has no chat template, and this server takes none from requests "
                "(request_level.allow_request_chat_template is off): send the prompt as text or token ids"
            )
        template = chat.template
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=chat.add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
    except TemplateError as exc:  # a syntax error in a request's template, or the template's raise_exception
        raise InvalidRequest(f"the chat template refused the conversation: {exc}") from None
    return [int(t) for t in ids]
