"""No client-chosen request id or tenant can alias a Redis key that another record owns.

Each example runs a victim request and, beside it, a request whose id and tenant hypothesis
draws (the victim's id with the schema's suffixes, braces, globs, whitespace, control characters
and arbitrary text). The victim's output must equal ``model.generate`` and its record must stay
as it was, and Redis must hold only keys the schema documents.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.keys import KeySchema, is_safe_name
from common.pb import generate_pb2 as pb
from common.redis_client import connect
from tests.executor_service.reference import Reference, load_reference_model, reference_greedy
from tests.scheduler_service.test_end_to_end import greedy
from tests.stack import Stack, eventually, joined_tokens, stack_config, start_stack

VICTIM_PROMPT = [5, 17, 99, 3, 250, 41, 8]
VICTIM_TOKENS = 12
SUFFIXES = [":tokens", ":out", ":running", "}", "{", "*", "?", "[a]", " ", "\n", "\x00", "|x", ""]
_victims = itertools.count()


@pytest.fixture(scope="module")
async def key_stack(redis_server: object, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    redis_server.flush()  # type: ignore[attr-defined]
    stack = await start_stack(stack_config(redis_server.url, tiny_model_dir))  # type: ignore[attr-defined]
    yield stack
    await stack.stop()


@pytest.fixture(scope="module")
def victim_reference(tiny_model_dir: Path) -> Reference:
    return reference_greedy(load_reference_model(tiny_model_dir), VICTIM_PROMPT, VICTIM_TOKENS)


@st.composite
def names(draw: st.DrawFn, victim: str) -> str:
    kind = draw(st.sampled_from(["victim", "text", "safe"]))
    if kind == "victim":
        return victim + draw(st.sampled_from(SUFFIXES)) + draw(st.text(max_size=4))
    if kind == "text":
        return draw(st.text(max_size=140))
    return draw(st.from_regex(r"[A-Za-z0-9._@-]{1,20}", fullmatch=True))


async def _complete(stack: Stack, request: pb.GenerateRequest) -> pb.CompleteResponse | grpc.StatusCode:
    try:
        return cast(pb.CompleteResponse, await stack.stub.Complete(request, timeout=60))
    except grpc.aio.AioRpcError as exc:
        return exc.code()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_no_id_or_tenant_can_touch_another_request(
    key_stack: Stack, victim_reference: Reference, data: st.DataObject
) -> None:
    victim_id = f"victim-{next(_victims)}"
    victim = greedy(VICTIM_PROMPT, VICTIM_TOKENS, request_id=victim_id)
    victim.tenant = "alpha"
    victim.params.ignore_eos = True
    victim_task = asyncio.ensure_future(key_stack.generate(victim))
    # The victim is accepted first, so a drawn id equal to its own must meet ALREADY_EXISTS.
    store = key_stack.scheduler.frontend.store

    async def accepted() -> bool:
        return bool(await store.redis.exists(store.keys.request(victim_id)))

    await eventually(accepted, f"{victim_id} to be accepted")
    other = greedy([7, 7, 7], 2, request_id=data.draw(names(victim_id), "request_id"))
    other.tenant = data.draw(names("alpha"), "tenant")

    outcome = await _complete(key_stack, other)
    victim_tokens = joined_tokens(await victim_task)

    # Empty means "the server picks": a fresh id, the default tenant.
    well_formed = all(not name or is_safe_name(name) for name in (other.request_id, other.tenant))
    if isinstance(outcome, grpc.StatusCode):
        assert outcome in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS), outcome
        assert (outcome is grpc.StatusCode.INVALID_ARGUMENT) != well_formed
    else:
        assert well_formed
    assert victim_tokens == victim_reference.tokens
    keys = KeySchema()
    client = connect(key_stack.config.distributed.redis_url)
    try:
        record = await client.hgetall(keys.request(victim_id))
        assert record["state"] == "FINISHED" and record["tenant"] == "alpha", record
        assert record["prompt_ids"] == ",".join(map(str, VICTIM_PROMPT))
        assert await client.lrange(keys.tokens(victim_id), 0, -1) == [str(t) for t in victim_reference.tokens]
        stray = [key async for key in client.scan_iter(count=1000) if not keys.owns(key)]
        assert not stray, stray
    finally:
        await client.aclose()
