"""scheduler_service.chat without a server: what a conversation must be, and its prompt ids under the
generated model's real tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from common.errors import FailedPrecondition, InvalidRequest
from common.pb import generate_pb2 as pb
from scheduler_service.chat import Chat, ChatMessage, ToolCall, chat_prompt_ids

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def untemplated(tiny_model_dir: Path) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    return tokenizer


def chat(messages: list[dict[str, str]] = MESSAGES, **fields: Any) -> Chat:
    return Chat(tuple(ChatMessage(m["role"], m["content"]) for m in messages), **fields)


def test_from_pb_defaults_to_a_generation_prompt() -> None:
    msg = pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")])
    assert Chat.from_pb(msg) == Chat((ChatMessage("user", "Hi"),), "", True)
    msg.add_generation_prompt = False
    msg.chat_template = "T"
    assert Chat.from_pb(msg) == Chat((ChatMessage("user", "Hi"),), "T", False)


@pytest.mark.parametrize(
    "messages,match",
    [
        ([], "no messages"),
        ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
        ([{"role": "", "content": ""}], "role ''"),
    ],
)
def test_malformed_chats_are_invalid(messages: list[dict[str, str]], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        chat(messages)


def test_chars_count_roles_contents_and_template() -> None:
    assert chat().chars == len("system") + len("Be brief.") + len("user") + len("Hello there")
    assert chat(template="abc").chars == chat().chars + 3


def test_the_models_template_gives_what_apply_chat_template_gives(tokenizer: Any) -> None:
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert chat_prompt_ids(tokenizer, chat(), allow_request_template=False) == expected
    assert expected[0] == tokenizer.bos_token_id and tokenizer.eos_token_id in expected
    no_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, return_dict=False)
    assert chat_prompt_ids(tokenizer, chat(add_generation_prompt=False), False) == no_prompt
    assert len(no_prompt) < len(expected)
    # A request's template replaces the model's where the server takes them, and is refused elsewhere.
    plain = tokenizer.apply_chat_template(MESSAGES, chat_template=PLAIN, add_generation_prompt=True, return_dict=False)
    assert chat_prompt_ids(tokenizer, chat(template=PLAIN), allow_request_template=True) == plain != expected
    with pytest.raises(FailedPrecondition, match="leave chat_template out to use the model's"):
        chat_prompt_ids(tokenizer, chat(template=PLAIN), allow_request_template=False)


def test_special_tokens_on_top_of_the_template_only_when_asked(tokenizer: Any) -> None:
    templated = chat_prompt_ids(tokenizer, chat(), allow_request_template=False)
    doubled = chat_prompt_ids(tokenizer, chat(add_special_tokens=True), allow_request_template=False)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert doubled == tokenizer.encode(text, add_special_tokens=True) != templated
    assert doubled[:2] == [tokenizer.bos_token_id] * 2  # the tokenizer's BOS before the template's
    msg = pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")], add_special_tokens=True)
    assert Chat.from_pb(msg).add_special_tokens


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def test_tools_and_tool_calls_reach_the_template(tokenizer: Any) -> None:
    called = ChatMessage("assistant", "", (ToolCall("c1", "weather", '{"city": "Oslo"}'),))
    answered = ChatMessage("tool", "sunny", tool_call_id="c1", name="weather")
    conversation = chat(tools_json=json.dumps(TOOLS))
    conversation = Chat((*conversation.messages, called, answered), tools_json=conversation.tools_json)
    expected_messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "weather"},
    ]
    expected = tokenizer.apply_chat_template(
        expected_messages, tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    ids = chat_prompt_ids(tokenizer, conversation, allow_request_template=False)
    assert ids == expected
    text = tokenizer.decode(ids)
    assert (
        '"name": "weather"' in text
        and '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    )
    assert conversation.chars == chat().chars + len(conversation.tools_json) + len("assistant") + len(
        "c1weather"
    ) + len('{"city": "Oslo"}') + len("toolsunnyc1weather")


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"tools_json": '{"type": "function"}'}, "tools must be a JSON array of objects"),
        ({"tools_json": "[1, 2]"}, "tools must be a JSON array of objects"),
        ({"tools_json": "[{"}, "chat tools must be JSON"),
        ({"documents_json": '["text"]'}, "documents must be a JSON array of objects"),
        ({"documents_json": "{"}, "chat documents must be JSON"),
    ],
)
def test_malformed_tools_are_invalid(fields: dict[str, str], says: str) -> None:
    with pytest.raises(InvalidRequest, match=says):
        chat(MESSAGES, **fields)


def test_documents_reach_a_template_that_cites_them(tokenizer: Any) -> None:
    citing = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}" + PLAIN
    documents = [{"title": "Mill", "text": "The wheel stopped."}]
    conversation = chat(template=citing, documents_json=json.dumps(documents))
    ids = chat_prompt_ids(tokenizer, conversation, allow_request_template=True)
    assert tokenizer.decode(ids).startswith("[Mill: The wheel stopped.]system: Be brief.")
    assert conversation.chars == chat(template=citing).chars + len(conversation.documents_json)
    assert Chat.from_pb(pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")], documents="[]")).documents == []


def test_tool_call_arguments_must_be_json() -> None:
    with pytest.raises(InvalidRequest, match="arguments must be JSON"):
        Chat((ChatMessage("assistant", "", (ToolCall("c1", "f", "{city: Oslo}"),)),))
    msg = pb.Chat(
        messages=[
            pb.ChatMessage(
                role="assistant", tool_calls=[pb.ToolCall(id="c", name="f", arguments="{}")], tool_call_id="x", name="n"
            )
        ],
        tools="[]",
    )
    parsed = Chat.from_pb(msg)
    assert (
        parsed.messages[0] == ChatMessage("assistant", "", (ToolCall("c", "f", "{}"),), "x", "n") and parsed.tools == []
    )


def test_a_model_without_a_template(untemplated: Any, tokenizer: Any) -> None:
    with pytest.raises(FailedPrecondition, match="no chat template"):
        chat_prompt_ids(untemplated, chat(), allow_request_template=True)
    with pytest.raises(FailedPrecondition, match="allow_request_chat_template is off"):
        chat_prompt_ids(untemplated, chat(template=PLAIN), allow_request_template=False)
    ids = chat_prompt_ids(untemplated, chat(template=PLAIN), allow_request_template=True)
    assert ids == tokenizer("system: Be brief.\nuser: Hello there\n", add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    "template",
    ["{% for m in messages %}", "{{ raise_exception('roles must alternate') }}", "{{ messages[0].x.y }}"],
    ids=["syntax error", "raise_exception", "undefined"],
)
def test_a_template_error_is_invalid_argument(untemplated: Any, template: str) -> None:
    with pytest.raises(InvalidRequest, match="chat template refused"):
        chat_prompt_ids(untemplated, chat(template=template), allow_request_template=True)
