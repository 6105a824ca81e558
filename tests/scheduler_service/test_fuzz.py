"""Fuzz the Generate request space: no crash, and only documented status codes."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.pb import generate_pb2 as pb
from tests.stack import Stack, stack_config, start_stack

DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
async def fuzz_stack(redis_server: object, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    redis_server.flush()  # type: ignore[attr-defined]
    stack = await start_stack(stack_config(redis_server.url, tiny_model_dir))  # type: ignore[attr-defined]
    yield stack
    await stack.stop()


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0, -1.0]))


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=140))),
        prompt=draw(st.text(max_size=60)),
        prompt_token_ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=8)),
        tenant=draw(st.text(max_size=140)),
        deadline_ms=draw(st.sampled_from([0, 1, 2**63])),
    )
    if draw(st.booleans()):
        msg.priority = draw(st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        msg.params.max_tokens = draw(st.sampled_from([0, 1, 3, 5000, 2**32 - 1]))
    else:
        msg.params.max_tokens = 2  # keep generation short when the rest is valid
    msg.params.temperature = draw(floats)
    msg.params.top_p = draw(floats)
    msg.params.top_k = draw(st.integers(0, 2**32 - 1))
    msg.params.stop.extend(draw(st.lists(st.text(max_size=20), max_size=20)))
    msg.params.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=5)))
    msg.params.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        msg.params.seed = draw(st.integers(0, 2**64 - 1))
    return msg


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=generate_requests())
async def test_generate_never_crashes(fuzz_stack: Stack, request: pb.GenerateRequest) -> None:
    try:
        reply = await fuzz_stack.stub.Complete(request, timeout=60)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in DOCUMENTED, (exc.code(), exc.details(), request)
        assert exc.details()
        return
    assert reply.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert math.isfinite(request.params.temperature)
