"""Prometheus /metrics on both services, scraped after real traffic."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from common.pb import generate_pb2 as pb
from tests.conftest import free_port
from tests.scheduler_service.test_end_to_end import greedy, random_prompts
from tests.stack import eventually, stack_config, start_stack


def scrape(port: int) -> dict[str, float]:
    """Sample name (with sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


async def test_metrics_move_with_traffic(redis_url: str, tiny_model_dir: Path) -> None:
    scheduler_port, executor_port = free_port(), free_port()
    monitoring = {"metrics_port": scheduler_port, "executor_metrics_port": executor_port}
    config = stack_config(redis_url, tiny_model_dir, monitoring=monitoring)
    stack = await start_stack(config)
    try:
        before = scrape(scheduler_port)
        assert before["baton:executors_alive"] == 1
        requests = [greedy(p, 6) for p in random_prompts(5, seed=41)]
        await asyncio.gather(*(stack.generate(r) for r in requests))
        call = stack.stub.Generate(greedy([1, 4, 4], 3000, request_id="metrics-cancel"))
        async for _ in call:
            break
        await stack.stub.Cancel(pb.CancelRequest(request_id="metrics-cancel"))

        async def cancel_counted() -> bool:
            return scrape(scheduler_port).get("baton:request_success_total{finished_reason=abort}", 0) >= 1

        await eventually(cancel_counted, "the cancelled request to finish")
        after = scrape(scheduler_port)
        executor = scrape(executor_port)
    finally:
        await stack.stop()
    assert after["baton:generation_tokens_total"] - before.get("baton:generation_tokens_total", 0) >= 30
    assert after["baton:request_success_total{finished_reason=length}"] == 5
    assert after["baton:time_to_first_token_seconds_count"] >= 5
    assert after["baton:e2e_request_latency_seconds_count"] >= 5
    assert after["baton:inter_token_latency_seconds_count"] >= 25
    assert after["baton:prompt_tokens_total"] == sum(len(r.prompt_token_ids) for r in requests) + 3
    assert after["baton:requests_aborted_total{reason=cancelled}"] == 1
    assert after["baton:kv_cache_usage_perc{executor=exec-0}"] >= 0
    assert after["baton:step_time_seconds_count{executor=exec-0}"] > 0
    assert after["baton:plan_latency_seconds_count"] > 0
    assert executor["baton:executor_tokens_total"] >= 30
    assert executor["baton:executor_step_time_seconds_count"] > 0
    assert executor["baton:gpu_memory_used_bytes"] > 0  # process memory on a CPU host
