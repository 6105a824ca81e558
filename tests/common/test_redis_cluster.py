"""Baton on a real 3-primary Redis Cluster: scripts in one slot, streams over the shards, sharded
pub/sub for the control channel, and greedy outputs exactly those of ``model.generate``."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from common.keys import KeySchema
from common.lifecycle import FinishReason
from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from common.redis_client import connect, is_cluster
from common.sampling_params import SamplingParams
from executor_service.server import start_executor
from scheduler_service.requests import NewRequest, TokenEvent
from scheduler_service.server import start_scheduler
from scheduler_service.store import Store
from scheduler_service.store.step_publisher import StepWrite
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.redis_topology import RedisClusterProcesses, redis_cli
from tests.scheduler_service.test_end_to_end import greedy, random_prompts
from tests.stack import Stack, joined_tokens, stack_config, start_stack


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: RedisClusterProcesses) -> str:
    redis_cluster.flush()
    return redis_cluster.url


@pytest.fixture
async def stack(cluster_url: str, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    running = await start_stack(stack_config(cluster_url, tiny_model_dir))
    yield running
    await running.stop()


def _command_calls(cluster: RedisClusterProcesses, command: str) -> int:
    total = 0
    for node in cluster.nodes:
        for line in redis_cli(node.port, "INFO", "commandstats").splitlines():
            if line.startswith(f"cmdstat_{command}:"):
                total += int(line.split("calls=")[1].split(",")[0])
    return total


async def test_cluster_url_gives_a_cluster_client(cluster_url: str) -> None:
    client = connect(cluster_url)
    try:
        assert is_cluster(client)
        await client.set("{baton}:probe", "1")
        assert await client.get("{baton}:probe") == "1"
    finally:
        await client.aclose()


async def _claimed_after_script_flush(
    client: aioredis.Redis, cluster: RedisClusterProcesses, claims: dict[str, str]
) -> Store:
    """A store whose requests (id -> executor) are queued and claimed, then every node's scripts flushed:
    what a promoted replica or restarted primary looks like."""
    store = Store(client, KeySchema(), request_ttl_s=60)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for request_id, executor_id in claims.items():
        await store.requests.enqueue(NewRequest(request_id, (1, 5, 6), params, 5, "t", 0, 0), 0.0, 100)
        assert await store.requests.claim(request_id, executor_id) is not None
    for node in cluster.nodes:
        redis_cli(node.port, "SCRIPT", "FLUSH")
    return store


async def test_pipelined_scripts_survive_a_node_that_lost_them(
    cluster_url: str, redis_cluster: RedisClusterProcesses
) -> None:
    """A promoted replica or restarted primary has an empty script cache: the step still records."""
    client = connect(cluster_url)
    try:
        store = await _claimed_after_script_flush(client, redis_cluster, {"r1": "exec-a"})
        usage = {"prompt_tokens": 3.0, "completion_tokens": 2.0}
        recorded = await store.steps.publish(
            "exec-a",
            [StepWrite("r1", TokenEvent(0, (7, 8), "ab", FinishReason.LENGTH, usage))],
        )
        assert recorded.accepted == [True]
        assert (await store.requests.get("r1") or {})["state"] == "FINISHED"
        events = await store.streams.read_events("r1", "0", 100)
        assert [(e.index, e.token_ids) for _, e in events] == [(0, (7, 8))]
    finally:
        await client.aclose()


async def test_steps_of_several_executors_share_one_pipeline_on_a_cluster(
    cluster_url: str, redis_cluster: RedisClusterProcesses
) -> None:
    """Concurrent step writes go out as one cluster pipeline, even to a node that lost its scripts."""
    client = connect(cluster_url)
    try:
        store = await _claimed_after_script_flush(client, redis_cluster, {f"r{i}": f"exec-{i}" for i in range(3)})
        trips = store.steps._record_step.round_trips
        accepted = await asyncio.gather(
            *(store.steps.publish(f"exec-{i}", [StepWrite(f"r{i}", TokenEvent(0, (7 + i,), "a"))]) for i in range(3))
        )
        assert [r.accepted for r in accepted] == [[True], [True], [True]]
        assert store.steps._record_step.round_trips == trips + 1
        for i in range(3):
            events = await store.streams.read_events(f"r{i}", "0", 100)
            assert [(e.index, e.token_ids) for _, e in events] == [(0, (7 + i,))]
    finally:
        await client.aclose()


async def test_greedy_streams_match_generate_and_spread_over_shards(
    stack: Stack, tiny_model_dir: Path, redis_cluster: RedisClusterProcesses
) -> None:
    prompts = random_prompts(12, seed=21)
    rng = random.Random(4)
    lengths = [rng.randrange(8, 40) for _ in prompts]

    async def one(i: int) -> list[int]:
        await asyncio.sleep(0.03 * i)  # join and leave a running batch at different moments
        return joined_tokens(await stack.generate(greedy(prompts[i], lengths[i], request_id=f"c-{i}")))

    outputs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    reference_model = load_reference_model(tiny_model_dir)
    for i, got in enumerate(outputs):
        assert_matches_reference(got, reference_greedy(reference_model, prompts[i], lengths[i]), f"prompt {i}")
    # Every {baton} key sits on one shard; the twelve output streams hash elsewhere.
    stream_nodes = {
        node.port
        for node in redis_cluster.nodes
        for i in range(len(prompts))
        if redis_cli(node.port, "EXISTS", f"baton:req:c-{i}:out").strip() == "1"
    }
    assert len(stream_nodes) >= 2, "output streams did not spread over the shards"


async def test_cancel_reaches_the_driving_replica_over_sharded_pubsub(
    stack: Stack, redis_cluster: RedisClusterProcesses
) -> None:
    """A second replica (no lease) takes the request and its cancel; the first aborts it."""
    second = await start_scheduler(stack.config)
    channel = None
    try:
        import grpc

        channel = grpc.aio.insecure_channel(f"127.0.0.1:{second.port}")
        stub = generate_pb2_grpc.GenerationStub(channel)
        before = _command_calls(redis_cluster, "spublish")
        call = stub.Generate(greedy([1, 5, 6, 7], 3000, request_id="far-cancel"))
        got = 0
        async for chunk in call:
            got += len(chunk.token_ids)
            if got >= 3:
                break
        assert not second.dispatcher.links, "the second replica should not drive the executor"
        reply = await stub.Cancel(pb.CancelRequest(request_id="far-cancel"))
        assert reply.state in (pb.REQUEST_STATE_RUNNING, pb.REQUEST_STATE_ASSIGNED)
        rest = [chunk async for chunk in call]
        assert rest[-1].finish_reason == pb.FINISH_REASON_CANCELLED
        assert _command_calls(redis_cluster, "spublish") > before
        assert _command_calls(redis_cluster, "publish") == 0
    finally:
        if channel is not None:
            await channel.close()
        await second.stop(grace=0.5)


async def test_baton_inspect_reads_a_cluster(stack: Stack, cluster_url: str) -> None:
    from baton.client_commands import collect_inspection

    await stack.stub.Complete(greedy([1, 5, 6], 4, request_id="inspected"))
    snapshot = await asyncio.to_thread(collect_inspection, cluster_url, "baton")
    assert [e["id"] for e in snapshot["executors"]] == ["exec-0"]
    assert snapshot["requests_by_state"].get("FINISHED", 0) >= 1


@pytest.mark.parametrize("service", ["scheduler", "executor"])
async def test_a_cluster_node_behind_a_plain_url_is_refused_at_start(
    redis_cluster: RedisClusterProcesses, tiny_model_dir: Path, service: str
) -> None:
    plain = f"redis://127.0.0.1:{redis_cluster.nodes[0].port}/0"
    config = stack_config(plain, tiny_model_dir)
    start = start_scheduler if service == "scheduler" else start_executor
    with pytest.raises(ValueError, match=r"is a Redis Cluster node.*use redis\+cluster://"):
        await start(config)
