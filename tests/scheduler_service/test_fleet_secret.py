"""The fleet secret on executors' ports: only a scheduler presenting it may drive an executor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.block_hashing import BlockNaming
from common.config import SecurityConfig
from common.pb import executor_pb2 as epb
from common.pb import executor_pb2_grpc
from common.pb import generate_pb2 as pb
from common.security import FLEET_SECRET_KEY, fleet_metadata, fleet_secret
from scheduler_service.executor_link import ExecutorLink
from scheduler_service.prompt_prefix import name_text
from tests.stack import Stack, stack_config, start_stack

SECRET = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"


@pytest.fixture
async def guarded_stack(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Stack]:
    """Scheduler and executor both configured with the secret (from a file, as a mounted Secret)."""
    secret_file = tmp_path / "fleet-secret"
    secret_file.write_text(SECRET + "\n")
    stack = await start_stack(stack_config(redis_url, tiny_model_dir, security={"fleet_secret_file": str(secret_file)}))
    yield stack
    await stack.stop()


def _short(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt="hello", params=pb.SamplingParams(max_tokens=3))


async def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 10)  # type: ignore[arg-type]
    return info.value.code()


async def _run_stream(stub: executor_pb2_grpc.ExecutorStub, metadata: tuple[tuple[str, str], ...]) -> None:
    async def plans() -> AsyncIterator[epb.Plan]:
        await asyncio.Event().wait()  # never sends a plan: only the attach is under test
        yield epb.Plan()  # pragma: no cover

    async for _ in stub.Run(plans(), metadata=metadata):
        pass


async def test_calls_without_the_secret_are_refused_and_leave_the_scheduler_attached(guarded_stack: Stack) -> None:
    executor = guarded_stack.executors[0]
    link = guarded_stack.scheduler.dispatcher.links[executor.executor_id]
    reply = await guarded_stack.stub.Complete(_short("before"))
    assert len(reply.token_ids) == 3
    wrong = ((FLEET_SECRET_KEY, SECRET[:-1] + "x"),)
    async with grpc.aio.insecure_channel(executor.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        for metadata in ((), wrong, (("authorization", f"Bearer {SECRET}"),)):
            assert await _code(stub.Info(epb.InfoRequest(), metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
            assert await _code(_run_stream(stub, metadata)) == grpc.StatusCode.UNAUTHENTICATED
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no secret
        info = await stub.Info(epb.InfoRequest(), metadata=((FLEET_SECRET_KEY, SECRET),))
        assert info.executor_id == executor.executor_id
    # Not superseded: the scheduler's own stream still drives the executor and serves requests.
    assert guarded_stack.scheduler.dispatcher.links[executor.executor_id] is link and link.ready
    reply = await guarded_stack.stub.Complete(_short("after"))
    assert len(reply.token_ids) == 3 and reply.finish_reason == pb.FINISH_REASON_LENGTH


async def test_a_scheduler_link_without_the_secret_cannot_attach(guarded_stack: Stack) -> None:
    executor = guarded_stack.executors[0]
    store = guarded_stack.scheduler.frontend.store
    config = guarded_stack.config.scheduler
    without = ExecutorLink(executor.executor_id, executor.address, store, config, lambda _moved: None)
    try:
        assert await _code(without.connect()) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await without.close()
    with_secret = ExecutorLink(
        executor.executor_id,
        executor.address,
        store,
        config,
        lambda _moved: None,
        security=SecurityConfig(fleet_secret=SECRET),
    )
    try:
        await with_secret.connect()  # Info only: no Run stream, so the scheduler's stays attached
        assert with_secret.info is not None and with_secret.info.executor_id == executor.executor_id
    finally:
        await with_secret.close()


def test_the_secret_comes_from_config_or_its_file(tmp_path: Path) -> None:
    assert fleet_metadata(SecurityConfig()) == ()  # off: nothing sent, nothing checked
    assert fleet_metadata(SecurityConfig(fleet_secret="abc")) == ((FLEET_SECRET_KEY, "abc"),)
    path = tmp_path / "fleet-secret"
    path.write_text("  from-a-file\n")
    assert fleet_secret(SecurityConfig(fleet_secret_file=str(path))) == "from-a-file"
    path.write_text("\n")
    with pytest.raises(ValueError, match="fleet secret"):
        fleet_secret(SecurityConfig(fleet_secret_file=str(path)))  # an empty file never turns the check off
    with pytest.raises(ValueError, match="not both"):
        SecurityConfig(fleet_secret="a", fleet_secret_file=str(path))
    with pytest.raises(ValueError, match="printable ASCII"):
        SecurityConfig(fleet_secret="has space")


async def test_a_keyed_fleet_names_prompts_as_its_executors_name_their_blocks(
    guarded_stack: Stack, redis_url: str
) -> None:
    """The scheduler and the executor key block names with the fleet secret alike: a repeat reads its
    prompt from the cache, and the record's names are the ones the executor's index holds."""
    prompt = list(range(100, 161))
    params = pb.SamplingParams(max_tokens=3, ignore_eos=True)
    usages = []
    for rid in ("keyed-1", "keyed-2"):
        request = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params)
        usages.append((await guarded_stack.generate(request))[-1].usage.cached_tokens)
    assert usages[0] == 0 and usages[1] > 0
    naming = BlockNaming.for_fleet(SECRET)
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        record = await client.hgetall("{baton}:req:keyed-2")  # type: ignore[misc]
        index = f"{{baton}}:prefix:executor:{guarded_stack.executors[0].executor_id}"
        held = await client.smembers(index)  # type: ignore[misc]
    finally:
        await client.aclose()
    names = str(record["prefix"]).split(",")
    assert names == [name_text(n) for n in naming.block_hashes(prompt, int(record["prefix_block"]))]
    assert set(names) <= held
