"""The gateway's reading of vLLM's /tokenize and /detokenize bodies."""

from __future__ import annotations

from typing import Any

import pytest

from common.pb import generate_pb2 as pb
from gateway.errors import BadRequest
from gateway.openai_tokenize import parse_detokenize, parse_tokenize, tokenize_answer


def test_a_prompt_adds_special_tokens_unless_told_not_to() -> None:
    model, call = parse_tokenize({"model": "m", "prompt": "hi"})
    assert model == "m" and call.text == "hi" and call.add_special_tokens and not call.return_token_strs
    _, bare = parse_tokenize({"prompt": "hi", "add_special_tokens": False, "return_token_strs": True})
    assert bare.HasField("add_special_tokens") and not bare.add_special_tokens and bare.return_token_strs


def test_neutral_values_and_other_fields_pass() -> None:
    body = {"prompt": "hi", "tools": [], "continue_final_message": False, "user": "u", "priority": 0}
    assert parse_tokenize(body)[1].text == "hi"


def test_messages_become_a_chat_with_its_generation_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    model, call = parse_tokenize({"messages": messages})
    assert model == "" and call.WhichOneof("input") == "chat"
    assert not call.chat.HasField("add_generation_prompt")  # Baton's default: true
    assert [(m.role, m.content) for m in call.chat.messages] == [("user", "hi")]
    options = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"a": 1}}
    continued = parse_tokenize({"messages": messages, **options})[1].chat
    assert not continued.add_generation_prompt and continued.HasField("add_generation_prompt")
    assert continued.continue_final_message and continued.chat_template_kwargs == '{"a": 1}'
    templated = parse_tokenize({"messages": messages, "chat_template": "{{ messages }}"})[1].chat
    assert templated.chat_template == "{{ messages }}"  # Baton decides whether it takes it
    assert not call.chat.add_special_tokens  # vLLM's default for a chat
    assert parse_tokenize({"messages": messages, "add_special_tokens": True})[1].chat.add_special_tokens


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({}, "either prompt or messages"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "either prompt or messages"),
        ({"prompt": 5}, "prompt must be a string"),
        ({"prompt": "a", "add_special_tokens": "yes"}, "true or false"),
        ({"messages": []}, "non-empty list"),
        ({"prompt": "a", "mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs="),
        ({"messages": [{"role": "user", "content": "b"}], "chat_template": 5}, "chat_template must be a string"),
        ({"messages": [{"role": "user", "content": "b"}], "tools": [{"type": "function"}]}, "each tool must be"),
        ({"prompt": "a", "model": 3}, "model must be a string"),
        ({"prompt": "a", "model": 0}, "model must be a string"),
    ],
)
def test_tokenize_refusals(body: dict[str, Any], says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        parse_tokenize(body)


@pytest.mark.parametrize("tokens", [None, "12", [1, "2"], [1, True], [-1], [2**32]])
def test_detokenize_takes_only_token_ids(tokens: Any) -> None:
    with pytest.raises(BadRequest):
        parse_detokenize({"tokens": tokens})
    assert parse_detokenize({"tokens": [0, 7, 2**32 - 1]})[1].token_ids == [0, 7, 2**32 - 1]


def test_the_answer_has_vllms_fields() -> None:
    out = pb.TokenizeResponse(token_ids=[1, 2], token_strs=["<s>", "a"], max_model_len=64)
    assert tokenize_answer(out, True) == {"count": 2, "max_model_len": 64, "tokens": [1, 2], "token_strs": ["<s>", "a"]}
    assert tokenize_answer(out, False)["token_strs"] is None
