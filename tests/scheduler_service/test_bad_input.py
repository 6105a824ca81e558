"""Bad input gets INVALID_ARGUMENT with a clear message, and leaves nothing behind in Redis."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from common.pb import generate_pb2 as pb
from tests.scheduler_service.test_end_to_end import greedy
from tests.stack import Stack, stack_config, start_stack


def request(**fields: object) -> pb.GenerateRequest:
    params = fields.pop("params", {})
    msg = pb.GenerateRequest(**({"prompt": "hello"} | fields))  # type: ignore[arg-type]
    for key, value in dict(params).items():  # type: ignore[call-overload]
        if isinstance(value, list):
            getattr(msg.params, key).extend(value)
        else:
            setattr(msg.params, key, value)
    return msg


BAD_REQUESTS = {
    "empty prompt": request(prompt=""),
    "token id out of vocabulary": request(prompt="", prompt_token_ids=[1, 10**6]),
    "prompt longer than the model": request(prompt="", prompt_token_ids=[5] * 5000),
    "prompt plus max_tokens too long": request(params={"max_tokens": 4096}),
    "negative temperature": request(params={"temperature": -0.5}),
    "NaN temperature": request(params={"temperature": math.nan}),
    "infinite temperature": request(params={"temperature": math.inf}),
    "top_p above one": request(params={"top_p": 1.5}),
    "negative top_p": request(params={"top_p": -0.1}),
    "NaN top_p": request(params={"top_p": math.nan}),
    "too many stop strings": request(params={"stop": ["x"] * 17}),
    "empty stop string": request(params={"stop": [""]}),
    "overlong stop string": request(params={"stop": ["y" * 257]}),
    "stop token id out of vocabulary": request(params={"stop_token_ids": [10**6]}),
    "priority above ten": request(priority=11),
    "deadline in the past": request(deadline_ms=1000),
    "bad request id": request(request_id="has spaces/and slashes"),
    "overlong tenant": request(tenant="t" * 200),
    "overlong request id": request(request_id="r" * 129),
    "max_tokens of zero": request(params={"max_tokens": 0}),
    "huge max_tokens": request(params={"max_tokens": 10**9}),
    "too many stop token ids": request(params={"stop_token_ids": [5] * 65}),
    "prompt text over the character limit": request(prompt="x" * 1_000_001),
    "empty token id list and no text": request(prompt="", prompt_token_ids=[]),
    "request id spelling another's token list": request(request_id="abc:tokens"),
    "tenant with a newline": request(tenant="x\ny"),
    "tenant with a hash-tag brace": request(tenant="{baton}"),
}


async def _request_keys(stack: Stack) -> list[str]:
    client = aioredis.Redis.from_url(stack.config.distributed.redis_url, decode_responses=True)
    try:
        return [k async for k in client.scan_iter(match="*req*")] + [k async for k in client.scan_iter(match="*queue*")]
    finally:
        await client.aclose()


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
async def test_bad_input_is_rejected_and_leaves_nothing(stack: Stack, case: str) -> None:
    for call in (stack.stub.Complete, lambda r: _drain(stack, r)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(BAD_REQUESTS[case])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert info.value.details()
    assert await _request_keys(stack) == []


async def _drain(stack: Stack, msg: pb.GenerateRequest) -> None:
    async for _ in stack.stub.Generate(msg):
        pass


async def test_duplicate_request_id_is_already_exists(stack: Stack) -> None:
    first = request(request_id="dup-1", params={"max_tokens": 2})
    await stack.stub.Complete(first)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stack.stub.Complete(first)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS


@pytest.mark.parametrize("rpc", ["Cancel", "GetRequest"])
async def test_unknown_request_id_is_not_found(stack: Stack, rpc: str) -> None:
    message = pb.CancelRequest(request_id="nope") if rpc == "Cancel" else pb.GetRequestRequest(request_id="nope")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await getattr(stack.stub, rpc)(message)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("request_id", ["done:tokens", "a b", "", "x" * 300, "{baton}:queue:pending"])
async def test_an_id_no_request_can_have_is_invalid_for_every_rpc_that_names_one(stack: Stack, request_id: str) -> None:
    """Read as a key, "done:tokens" is request done's token list (it answered INTERNAL): every RPC
    that names a request refuses an id that could not be one, before it looks anything up."""
    await stack.stub.Complete(greedy([1, 5, 6], 2, request_id="done"))

    async def resume() -> None:
        async for _ in stack.stub.Resume(pb.ResumeRequest(request_id=request_id)):
            pass

    calls = (
        stack.stub.Cancel(pb.CancelRequest(request_id=request_id)),
        stack.stub.GetRequest(pb.GetRequestRequest(request_id=request_id)),
        resume(),
    )
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert (await stack.stub.GetRequest(pb.GetRequestRequest(request_id="done"))).state == pb.REQUEST_STATE_FINISHED


async def _raw_call(stack: Stack, method: str, payload: bytes) -> grpc.StatusCode:
    call = stack.channel.unary_unary(f"/baton.v1.Generation/{method}")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(payload)
    return info.value.code()


async def test_invalid_utf8_prompt_is_invalid_argument(stack: Stack) -> None:
    # Field 2 (prompt), length-delimited, 2 bytes that are not UTF-8.
    payload = bytes([0x12, 0x02, 0xC3, 0x28])
    assert await _raw_call(stack, "Complete", payload) == grpc.StatusCode.INVALID_ARGUMENT
    assert await _request_keys(stack) == []


async def test_garbage_bytes_are_invalid_argument(stack: Stack) -> None:
    assert await _raw_call(stack, "GetRequest", b"\xff\xff\xff\xff") == grpc.StatusCode.INVALID_ARGUMENT


async def test_unknown_request_id_for_resume_is_not_found(stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stack.stub.Resume(pb.ResumeRequest(request_id="nope")):
            pass
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_oversized_message_is_resource_exhausted(redis_url: str, tiny_model_dir: Path) -> None:
    config = stack_config(redis_url, tiny_model_dir, scheduler={"max_message_bytes": 64 * 1024})
    small = await start_stack(config)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await small.stub.Complete(request(prompt="y" * 100_000))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await _request_keys(small) == []
    finally:
        await small.stop()


async def test_tokenize_has_the_prompt_character_limit(stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stack.stub.Tokenize(pb.TokenizeRequest(text="x" * 1_000_001))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 1000000" in (info.value.details() or "")
    assert len((await stack.stub.Tokenize(pb.TokenizeRequest(text="hello"))).token_ids) > 0


async def test_detokenize_refuses_ids_past_the_vocabulary_and_too_many(stack: Stack) -> None:
    for ids, says in (([5, 8192], "past the vocabulary"), ([5] * 1_000_001, "at most 1000000")):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in (info.value.details() or "")
    await stack.stub.Detokenize(pb.DetokenizeRequest(token_ids=[8191]))  # the last id is in it
