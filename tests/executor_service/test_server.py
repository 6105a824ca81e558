"""``start_executor``: the order of its start, as ``serve`` relies on it."""

from __future__ import annotations

from pathlib import Path

import grpc
import redis

from common.keys import KeySchema
from common.pb import executor_pb2, executor_pb2_grpc
from executor_service.server import start_executor
from tests.stack import stack_config


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


async def test_a_clean_stop_leaves_nothing_of_the_executor_in_redis(redis_url: str, tiny_model_dir: Path) -> None:
    store, keys = redis.Redis.from_url(redis_url, decode_responses=True), KeySchema("baton")
    config = stack_config(redis_url, tiny_model_dir)
    running = await start_executor(config)
    try:
        # What its scheduler's link would have indexed, had that replica died before the executor.
        store.sadd(keys.cached_blocks(running.executor_id), "abc")
    finally:
        await running.stop()
    try:
        assert store.zscore(keys.executors, running.executor_id) is None
        assert not store.exists(keys.executor(running.executor_id), keys.cached_blocks(running.executor_id))
    finally:
        store.close()
