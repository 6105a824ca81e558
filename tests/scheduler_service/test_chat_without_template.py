"""A model without a chat template (``baton make-model --no-chat-template``): a chat request is
FAILED_PRECONDITION, unless the server takes templates from requests and the request brings one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import grpc
import pytest
from transformers import AutoTokenizer

from baton.make_model import make_model
from common.config_loading import with_overrides
from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from scheduler_service.server import start_scheduler
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.scheduler_service.test_chat_end_to_end import CONVERSATION, chat_pb, greedy_chat
from tests.stack import joined_tokens, stack_config, start_stack

PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def untemplated_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model made with ``--no-chat-template``: the same weights and tokenizer, no template."""
    return make_model(tmp_path_factory.mktemp("untemplated"), size="tiny", seed=0, chat_template=False)


async def test_a_model_without_a_template_is_failed_precondition(redis_url: str, untemplated_model_dir: Path) -> None:
    config = stack_config(redis_url, untemplated_model_dir)
    # One scheduler takes templates from requests (its operator trusts the clients), the other does not.
    trusting = with_overrides(config, scheduler={"request_level": {"allow_request_chat_template": True}})
    stack = await start_stack(trusting)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.stub.Complete(greedy_chat(chat_pb(CONVERSATION), 4))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no chat template" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as tokenize_err:
            await stack.stub.Tokenize(pb.TokenizeRequest(chat=chat_pb(CONVERSATION)))
        assert tokenize_err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        # With the request's own template, the output is generate's on that template's ids.
        tokenizer = AutoTokenizer.from_pretrained(untemplated_model_dir)
        ids = cast(list[int], tokenizer.apply_chat_template(CONVERSATION, chat_template=PLAIN, return_dict=False))
        chunks = await stack.generate(greedy_chat(chat_pb(CONVERSATION, chat_template=PLAIN), 12))
        assert chunks[-1].usage.prompt_tokens == len(ids)
        reference = reference_greedy(load_reference_model(untemplated_model_dir), ids, 12)
        assert_matches_reference(joined_tokens(chunks), reference, "request template")
        # Variables reach the template.
        shouting = "{% for m in messages %}{{ m['content'] | upper if shout else m['content'] }}\n{% endfor %}"
        for shout in (True, False):
            chat = chat_pb(CONVERSATION, chat_template=shouting, chat_template_kwargs=json.dumps({"shout": shout}))
            expected = tokenizer.apply_chat_template(
                CONVERSATION, chat_template=shouting, shout=shout, return_dict=False
            )
            assert list((await stack.stub.Tokenize(pb.TokenizeRequest(chat=chat))).token_ids) == list(expected)
        with pytest.raises(grpc.aio.AioRpcError) as broken:
            await stack.stub.Complete(greedy_chat(chat_pb(CONVERSATION, chat_template="{% if %}"), 4))
        assert broken.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # A scheduler replica that takes no templates from requests refuses the same request.
        wary = await start_scheduler(config)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{wary.port}") as channel:
                request = greedy_chat(chat_pb(CONVERSATION, chat_template=PLAIN), 4)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await generate_pb2_grpc.GenerationStub(channel).Complete(request)
        finally:
            await wary.stop(grace=0.5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "allow_request_chat_template" in (refused.value.details() or "")
    finally:
        await stack.stop()
