"""vLLM's ``/tokenize`` and ``/detokenize`` bodies and answers, over Baton's ``Tokenize`` and
``Detokenize`` calls.

``/tokenize`` takes a ``prompt`` (``add_special_tokens``, default true) or chat ``messages``
(with the chat routes' ``add_generation_prompt``, ``continue_final_message``, ``chat_template``
and ``chat_template_kwargs``; the template places the special tokens), with
``return_token_strs`` for each token's piece, and answers ``count``, ``max_model_len``, ``tokens``
and ``token_strs``. ``/detokenize`` takes ``tokens`` and answers the ``prompt`` they spell.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.pb import generate_pb2 as pb
from gateway.errors import BadRequest
from gateway.openai_tools import template_tools
from gateway.openai_types import chat_input, chat_options, refuse_unsupported

# vLLM's fields that would change the tokens, with the values that mean "not asked for": anything
# else is refused rather than ignored. Other fields are ignored, as vLLM ignores extra ones.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "mm_processor_kwargs": (None, {}),
}


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise BadRequest("model must be a string", param="model")
    return model


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false", param=name)
    return value


def parse_tokenize(body: Mapping[str, Any]) -> tuple[str, pb.TokenizeRequest]:
    """The model asked for (empty: the served one) and the call."""
    refuse_unsupported(body, _UNSUPPORTED)
    request = pb.TokenizeRequest(return_token_strs=_flag(body, "return_token_strs", False))
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("give either prompt or messages", param="prompt")
    if messages is not None:
        request.chat.CopyFrom(chat_input(messages))
        chat_options(body, request.chat)
        request.chat.tools = template_tools(body)
    else:
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string", param="prompt")
        request.text = prompt
        request.add_special_tokens = _flag(body, "add_special_tokens", True)
    return _model(body), request


def tokenize_answer(out: pb.TokenizeResponse, with_strs: bool) -> dict[str, Any]:
    return {
        "count": len(out.token_ids),
        "max_model_len": out.max_model_len,
        "tokens": list(out.token_ids),
        "token_strs": list(out.token_strs) if with_strs else None,
    }


def parse_detokenize(body: Mapping[str, Any]) -> tuple[str, pb.DetokenizeRequest]:
    """The model asked for (empty: the served one) and the call."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("tokens must be a list of token ids", param="tokens")
    if any(not 0 <= t < 2**32 for t in tokens):
        raise BadRequest("tokens holds token ids out of range", param="tokens")
    return _model(body), pb.DetokenizeRequest(token_ids=tokens)
