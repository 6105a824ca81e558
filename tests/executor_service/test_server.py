"""``start_executor``: the order of its start, as ``serve`` relies on it; and what the executor does
when its engine thread fails."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import RedisError

from common.keys import KeySchema
from common.pb import executor_pb2, executor_pb2_grpc
from executor_service.engine_io import StepOutput
from executor_service.server import RunningExecutor, start_executor
from tests.conftest import free_port
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.scheduler_service.test_end_to_end import greedy, random_prompts
from tests.stack import Stack, eventually, stack_config, start_stack

_TOKENS = 200  # per stream: long enough to be running when an executor goes


async def test_before_serving_runs_before_the_executor_registers(redis_url: str, tiny_model_dir: Path) -> None:
    store, keys = redis.Redis.from_url(redis_url, decode_responses=True), KeySchema("baton")
    registered_then: list[int] = []

    def before_serving() -> None:
        # serve() freezes the heap here, after the warm-up: no scheduler knows of the executor yet.
        registered_then.append(store.zcard(keys.executors))

    running = await start_executor(stack_config(redis_url, tiny_model_dir), before_serving=before_serving)
    try:
        assert registered_then == [0]
        assert store.zcard(keys.executors) == 1  # registered after it
        # The backend it chose, in its Info and its metrics.
        async with grpc.aio.insecure_channel(running.address) as channel:
            info = await executor_pb2_grpc.ExecutorStub(channel).Info(executor_pb2.InfoRequest(), timeout=10)
        assert info.backend == running.loaded.backend == "cpu_native"
        assert info.kv_window_tokens == 0  # full attention: every block stays while its request runs
        assert running.metrics.registry.get_sample_value("baton:executor_backend", {"backend": "cpu_native"}) == 1
    finally:
        await running.stop()
        store.close()


async def test_a_clean_stop_retires_the_executor_for_the_reaper(redis_url: str, tiny_model_dir: Path) -> None:
    """Its record and prefix-cache index go at once; its registry entry stays, silent since
    forever, until a scheduler reaps it (none runs here)."""
    store, keys = redis.Redis.from_url(redis_url, decode_responses=True), KeySchema("baton")
    config = stack_config(redis_url, tiny_model_dir)
    running = await start_executor(config)
    try:
        # What its scheduler's link would have indexed, had that replica died before the executor.
        store.sadd(keys.cached_blocks(running.executor_id), "abc")
        assert running.peers is not None
        registered = running.peers.directory / str(os.getpid())
        assert registered.exists()  # other executors of this host count it while it runs
    finally:
        await running.stop()
    try:
        assert not registered.exists()
        assert store.zscore(keys.executors, running.executor_id) == 0
        assert not store.exists(keys.executor(running.executor_id), keys.cached_blocks(running.executor_id))
    finally:
        store.close()


@dataclass
class _Streaming:
    """Greedy streams of ``_TOKENS`` tokens running on a stack, each checked for gaps and repeats as
    its chunks come."""

    prompts: list[list[int]]
    ids: list[str]
    tokens: dict[str, list[int]]
    tasks: list[asyncio.Task[None]]

    @classmethod
    async def start(cls, stack: Stack, count: int, seed: int, prefix: str) -> _Streaming:
        """Once every stream has its first tokens."""
        prompts = random_prompts(count, seed=seed)
        ids = [f"{prefix}-{i}" for i in range(count)]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}

        async def stream(i: int) -> None:
            async for chunk in stack.stub.Generate(greedy(prompts[i], _TOKENS, request_id=ids[i])):
                assert chunk.index == len(tokens[ids[i]]), "a gap or a repeat in the stream"
                tokens[ids[i]].extend(chunk.token_ids)

        tasks = [asyncio.create_task(stream(i)) for i in range(count)]
        await eventually(lambda: min(len(t) for t in tokens.values()) >= 3, "every request to start", 60)
        return cls(prompts, ids, tokens, tasks)

    async def finish_exactly(self, model_dir: Path) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 120)
        reference_model = load_reference_model(model_dir)
        for prompt, rid in zip(self.prompts, self.ids, strict=True):
            assert_matches_reference(self.tokens[rid], reference_greedy(reference_model, prompt, _TOKENS), rid)


def _busiest(stack: Stack, store: redis.Redis) -> RunningExecutor:
    keys = KeySchema("baton")
    victim = max(stack.executors, key=lambda e: store.scard(keys.running(e.executor_id)))
    assert store.scard(keys.running(victim.executor_id)) > 0
    return victim


async def test_requests_a_cleanly_stopped_executor_could_not_hand_back_finish_elsewhere(
    redis_url: str, tiny_model_dir: Path
) -> None:
    """A clean stop (SIGTERM: a scale-down, a rolling update) ends the Run stream and the link hands
    the executor's requests back. A hand-back that fails (Redis unreachable at that moment) leaves a
    request recorded RUNNING there: the stopped executor must stay in the registry, silent, until a
    scheduler reaps it and re-queues what is left, or that request waits for good."""
    store, keys = redis.Redis.from_url(redis_url, decode_responses=True), KeySchema("baton")
    stack = await start_stack(stack_config(redis_url, tiny_model_dir), executors=2)
    try:
        streams = await _Streaming.start(stack, 6, seed=11, prefix="cs")
        victim = _busiest(stack, store)

        async def unreachable(request_id: str, kind: str = "preempt") -> None:
            raise RedisError("injected: Redis unreachable during the hand-back")

        stack.scheduler.dispatcher.links[victim.executor_id].hand_back = unreachable  # type: ignore[method-assign]
        await victim.stop(grace=0.5)
        stack.executors.remove(victim)
        await streams.finish_exactly(tiny_model_dir)
        # Re-queued by the reaper, as a planned stop's requests are: none spent a migration.
        assert any(store.hget(keys.request(rid), "requeued_ms") for rid in streams.ids)
        assert not any(store.hget(keys.request(rid), "migrations") for rid in streams.ids)
        await eventually(lambda: store.zscore(keys.executors, victim.executor_id) is None, "the reaper")
        assert store.scard(keys.running(victim.executor_id)) == 0
    finally:
        await stack.stop()
        store.close()


async def test_a_clean_stop_moves_its_requests_without_spending_their_migrations(
    redis_url: str, tiny_model_dir: Path
) -> None:
    """A scale-down or a rolling update is no failure: the requests its executor ran finish on the
    other, exactly, and none counts against ``max_migrations`` (0 here: one migration would fail it)."""
    store, keys = redis.Redis.from_url(redis_url, decode_responses=True), KeySchema("baton")
    config = stack_config(redis_url, tiny_model_dir)
    config = replace(config, distributed=replace(config.distributed, max_migrations=0))
    stack = await start_stack(config, executors=2)
    try:
        streams = await _Streaming.start(stack, 4, seed=12, prefix="cm")
        victim = _busiest(stack, store)
        moved: set[str] = store.smembers(keys.running(victim.executor_id))  # type: ignore[assignment]
        await victim.stop(grace=0.5)
        stack.executors.remove(victim)
        await streams.finish_exactly(tiny_model_dir)
        assert all(store.hget(keys.request(rid), "requeued_ms") for rid in moved)
        assert not any(store.hget(keys.request(rid), "migrations") for rid in streams.ids)
    finally:
        await stack.stop()
        store.close()


async def test_an_executor_whose_engine_fails_leaves_the_fleet_and_its_requests_finish_elsewhere(
    redis_url: str, tiny_model_dir: Path
) -> None:
    """A model step that raises ends the engine thread. The executor must not stay attached and
    heartbeating, taking plans it never runs (its requests would wait for good): it ends its Run
    stream, so its requests are re-queued and finish on the other executor, exactly, and it falls
    silent, so the scheduler reaps it."""
    store, keys = redis.Redis.from_url(redis_url, decode_responses=True), KeySchema("baton")
    stack = await start_stack(stack_config(redis_url, tiny_model_dir), executors=2)
    try:
        streams = await _Streaming.start(stack, 8, seed=5, prefix="ef")
        victim = _busiest(stack, store)

        def broken_step() -> StepOutput:
            raise RuntimeError("injected engine failure")

        victim.worker.engine.step = broken_step  # type: ignore[method-assign]
        await streams.finish_exactly(tiny_model_dir)
        migrated = [rid for rid in streams.ids if store.hget(keys.request(rid), "migrations")]
        assert migrated, "the failed executor ran none of the requests"
        await asyncio.wait_for(victim.withdrawn.wait(), 10)
        # Its heartbeats stopped: the scheduler reaps it, re-queueing anything still recorded there.
        reaped = "the scheduler to reap the failed executor"
        await eventually(lambda: store.zscore(keys.executors, victim.executor_id) is None, reaped)
        assert store.scard(keys.running(victim.executor_id)) == 0
        async with grpc.aio.insecure_channel(victim.address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            try:
                await executor_pb2_grpc.ExecutorStub(channel).Info(executor_pb2.InfoRequest(), timeout=10)
                raise AssertionError("an executor whose engine failed answered Info")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                assert "engine failed" in (exc.details() or "")
    finally:
        await stack.stop()
        store.close()


# The executor's command line, with its engine thread failing on its first iteration.
_FAILING_EXECUTOR = """
import sys
from executor_service.worker import EngineWorker
def fail(self, block):
    raise RuntimeError("injected engine failure")
EngineWorker._apply_pending = fail
from baton.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_executor_process_exits_non_zero_when_its_engine_fails(redis_url: str, tiny_model_dir: Path) -> None:
    """So that a supervisor (compose's restart policy, Kubernetes) starts a fresh one."""
    keys = KeySchema("baton")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "BATON_DISTRIBUTED__REDIS_URL": redis_url,
        "BATON_EXECUTOR__MODEL": str(tiny_model_dir),
        "BATON_EXECUTOR__KV_CACHE_MEMORY_MB": "32",
        "BATON_EXECUTOR__TORCH_THREADS": "1",
    }
    command = [sys.executable, "-c", _FAILING_EXECUTOR, "executor", "--host", "127.0.0.1", "--port", str(free_port())]
    done = subprocess.run([*command, "--executor-id", "exec-broken"], env=env, capture_output=True, timeout=180)
    log = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
    assert done.returncode == 1, log[-3000:]
    assert "the engine thread failed" in log
    with redis.Redis.from_url(redis_url, decode_responses=True) as store:
        # Still registered, silent: the schedulers' reaper re-queues whatever Redis records it ran.
        assert store.zscore(keys.executors, "exec-broken") is not None
