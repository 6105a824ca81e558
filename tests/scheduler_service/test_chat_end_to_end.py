"""Chat requests through gRPC: the scheduler renders the conversation with the model's chat template,
and greedy output equals ``model.generate`` on those ids alone; a bad conversation is INVALID_ARGUMENT."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from common.config_loading import with_overrides
from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from scheduler_service.server import start_scheduler
from tests.conftest import RedisServer
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.stack import Stack, joined_tokens, stack_config, start_stack

CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Where does the river run?"},
    {"role": "assistant", "content": "Past the old mill."},
    {"role": "user", "content": "And then?"},
]


def chat_pb(messages: list[dict[str, str]], **fields: object) -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(**m) for m in messages], **fields)  # type: ignore[arg-type]


def greedy_chat(chat: pb.Chat, max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, chat=chat, params=params)


@pytest.fixture(scope="module")
async def stack(redis_server: RedisServer, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    redis_server.flush()
    running = await start_stack(stack_config(redis_server.url, tiny_model_dir))
    yield running
    await running.stop()


async def test_greedy_chat_equals_generate_on_the_templated_ids(stack: Stack, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = list(tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False))
    chunks = await stack.generate(greedy_chat(chat_pb(CONVERSATION), 24))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), 24)
    reference = reference_greedy(load_reference_model(tiny_model_dir), ids, 24)
    assert_matches_reference(joined_tokens(chunks), reference, "chat")
    # Complete and GetRequest see the same templated prompt.
    whole = await stack.stub.Complete(greedy_chat(chat_pb(CONVERSATION), 24, request_id="chat-whole"))
    assert list(whole.token_ids) == joined_tokens(chunks) and whole.usage.prompt_tokens == len(ids)
    status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id="chat-whole"))
    assert status.prompt_tokens == len(ids)


async def test_tokenize_takes_a_chat(stack: Stack, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for add in (True, False):
        expected = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=add, return_dict=False)
        chat = chat_pb(CONVERSATION, add_generation_prompt=add)
        assert list((await stack.stub.Tokenize(pb.TokenizeRequest(chat=chat))).token_ids) == list(expected)
    # Text keeps working as before.
    text = await stack.stub.Tokenize(pb.TokenizeRequest(text="Hello"))
    assert list(text.token_ids) == tokenizer("Hello").input_ids
    assert not text.token_strs  # only when asked


async def test_tokenize_options_and_detokenize_round_trip(stack: Stack, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The river runs past the old mill."
    bare = await stack.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=False, return_token_strs=True))
    assert list(bare.token_ids) == tokenizer(text, add_special_tokens=False).input_ids
    assert list(bare.token_strs) == tokenizer.convert_ids_to_tokens(list(bare.token_ids))
    info = await stack.stub.ModelInfo(pb.ModelInfoRequest())
    assert bare.max_model_len == info.max_model_len > 0
    full = await stack.stub.Tokenize(pb.TokenizeRequest(text=text))
    assert list(full.token_ids) == tokenizer(text).input_ids != list(bare.token_ids)  # the BOS
    back = await stack.stub.Detokenize(pb.DetokenizeRequest(token_ids=full.token_ids))
    assert back.text == tokenizer.decode(list(full.token_ids)) and back.text.endswith(text)
    assert (await stack.stub.Detokenize(pb.DetokenizeRequest(token_ids=bare.token_ids))).text == text
    assert (await stack.stub.Detokenize(pb.DetokenizeRequest())).text == ""


async def test_a_chat_can_end_inside_its_last_message(stack: Stack, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    begun = [*CONVERSATION, {"role": "assistant", "content": "It runs to"}]
    chat = chat_pb(begun, add_generation_prompt=False, continue_final_message=True)
    expected = list(tokenizer.apply_chat_template(begun, continue_final_message=True, return_dict=False))
    assert list((await stack.stub.Tokenize(pb.TokenizeRequest(chat=chat))).token_ids) == expected
    closed = list(tokenizer.apply_chat_template(begun, return_dict=False))
    assert closed[: len(expected)] == expected and len(closed) > len(expected)  # the turn's end left off
    whole = await stack.stub.Complete(greedy_chat(chat, 6))
    assert whole.usage.prompt_tokens == len(expected)
    # Variables the model's template does not use change nothing; one it uses reaches it.
    quiet = chat_pb(CONVERSATION, chat_template_kwargs='{"verbose": false}')
    plain = list(tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False))
    assert list((await stack.stub.Tokenize(pb.TokenizeRequest(chat=quiet))).token_ids) == plain
    unthinking = chat_pb(CONVERSATION, chat_template_kwargs='{"enable_thinking": false}')
    thoughtless = tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, enable_thinking=False, return_dict=False
    )
    assert list((await stack.stub.Tokenize(pb.TokenizeRequest(chat=unthinking))).token_ids) == thoughtless != plain


async def test_a_request_template_replaces_the_models_only_where_the_server_takes_them(
    stack: Stack, tiny_model_dir: Path
) -> None:
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    chat = chat_pb(CONVERSATION, chat_template=plain)
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # this server takes none: refused, never ignored
        await stack.stub.Tokenize(pb.TokenizeRequest(chat=chat))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "leave chat_template out" in (refused.value.details() or "")
    trusting = await start_scheduler(
        with_overrides(stack.config, scheduler={"request_level": {"allow_request_chat_template": True}})
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{trusting.port}") as channel:
            out = await generate_pb2_grpc.GenerationStub(channel).Tokenize(pb.TokenizeRequest(chat=chat))
    finally:
        await trusting.stop(grace=0.5)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = tokenizer.apply_chat_template(
        CONVERSATION, chat_template=plain, add_generation_prompt=True, return_dict=False
    )
    assert list(out.token_ids) == list(expected)


BAD_CHATS = {
    "no messages": pb.GenerateRequest(chat=pb.Chat()),
    "unknown role": pb.GenerateRequest(chat=chat_pb([{"role": "narrator", "content": "x"}])),
    "empty role": pb.GenerateRequest(chat=chat_pb([{"role": "", "content": "x"}])),
    "over the character limit": pb.GenerateRequest(chat=chat_pb([{"role": "user", "content": "x" * 1_000_000}])),
    "chat and token ids": pb.GenerateRequest(chat=chat_pb(CONVERSATION), prompt_token_ids=[1, 5]),
    "continuing and starting a reply": pb.GenerateRequest(chat=chat_pb(CONVERSATION, continue_final_message=True)),
    "template variables not JSON": pb.GenerateRequest(chat=chat_pb(CONVERSATION, chat_template_kwargs="{")),
    "template variables not an object": pb.GenerateRequest(chat=chat_pb(CONVERSATION, chat_template_kwargs="[1]")),
    "template variable the call sets": pb.GenerateRequest(
        chat=chat_pb(CONVERSATION, chat_template_kwargs='{"add_generation_prompt": false}')
    ),
    "template variable for the messages": pb.GenerateRequest(
        chat=chat_pb(CONVERSATION, chat_template_kwargs='{"messages": []}')
    ),
    "template variables over the character limit": pb.GenerateRequest(
        chat=chat_pb(CONVERSATION, chat_template_kwargs=json.dumps({"x": "y" * 1_000_000}))
    ),
    "templated prompt longer than the model": pb.GenerateRequest(
        chat=chat_pb([{"role": "user", "content": "river " * 5000}])
    ),
    "templated prompt plus max_tokens too long": pb.GenerateRequest(
        chat=chat_pb(CONVERSATION), params=pb.SamplingParams(max_tokens=4090)
    ),
}
MALFORMED = (
    "no messages",
    "unknown role",
    "empty role",
    "over the character limit",
    "continuing and starting a reply",
    "template variables not JSON",
    "template variables not an object",
    "template variable the call sets",
    "template variable for the messages",
    "template variables over the character limit",
)


@pytest.mark.parametrize("name", list(BAD_CHATS))
async def test_bad_chats_are_invalid_argument(stack: Stack, name: str) -> None:
    request = BAD_CHATS[name]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.Complete(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    if name in MALFORMED:  # Tokenize judges the conversation alone, with no request's limits
        with pytest.raises(grpc.aio.AioRpcError) as tokenize_err:
            await stack.stub.Tokenize(pb.TokenizeRequest(chat=request.chat))
        assert tokenize_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_bad_chat_in_a_batch_stream_fails_alone(stack: Stack) -> None:
    async def requests() -> AsyncIterator[pb.GenerateRequest]:
        yield pb.GenerateRequest(chat=chat_pb([{"role": "narrator", "content": "x"}]))
        yield greedy_chat(chat_pb(CONVERSATION), 3)

    events = [event async for message in stack.stub.GenerateBatch(requests()) for event in message.events]
    refused = [e for e in events if e.position == 0]
    assert [e.error_code for e in refused] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]]
    finished = [e for e in events if e.position == 1 and e.response.finish_reason]
    assert finished and finished[-1].response.usage.completion_tokens == 3
