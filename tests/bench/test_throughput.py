"""Smoke tests of bench/throughput.py: its setup plumbing and the in-process engine phase on the tiny model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from bench import device_watch as watch
from bench import throughput as tp
from bench import throughput_e2e as e2e
from tests.stack import stack_config, start_stack


def test_kv_memory_follows_the_model_dtype(tmp_path: Path) -> None:
    wl = tp.make_workload(64, 0)
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        model = tmp_path / dtype
        model.mkdir()
        config = {"num_attention_heads": 32, "hidden_size": 2048, "num_hidden_layers": 22, "num_key_value_heads": 8}
        (model / "config.json").write_text(json.dumps(config | {"dtype": dtype}))
        sizes[dtype] = tp.kv_memory_mb(model, wl)
    assert sizes["bfloat16"] < sizes["float32"] <= 2 * sizes["bfloat16"] + 256
    assert tp.kv_memory_mb(tmp_path / "bfloat16", wl, block=256) > sizes["bfloat16"]  # whole blocks of 256


def test_stack_env_carries_the_setup() -> None:
    setup = tp.Setup(
        device="cpu",
        dtype="bfloat16",
        max_batch=8,
        token_budget=64,
        executor_threads=1,
        stream_interval=4,
        report_every_steps=8,
        block_size=256,
    )
    env = e2e.stack_env(setup, kv_mb=300, metrics_port=9999)
    assert env["BATON_EXECUTOR__DTYPE"] == "bfloat16" and env["BATON_EXECUTOR__DEVICE"] == "cpu"
    assert env["BATON_EXECUTOR__MAX_BATCH_SIZE"] == env["BATON_SCHEDULER__BATCH_LEVEL__MAX_BATCH_SIZE"] == "8"
    assert env["BATON_SCHEDULER__TOKEN_LEVEL__TOKEN_BUDGET"] == "64"
    assert env["BATON_EXECUTOR__TORCH_THREADS"] == "1" and env["BATON_EXECUTOR__KV_CACHE_MEMORY_MB"] == "300"
    assert env["BATON_DISTRIBUTED__STREAM_INTERVAL_TOKENS"] == "4"
    assert env["BATON_EXECUTOR__REPORT_EVERY_STEPS"] == "8"
    assert env["BATON_MONITORING__EXECUTOR_METRICS_PORT"] == "9999"
    assert env["BATON_EXECUTOR__BLOCK_SIZE"] == "256"


def test_executors_flag_reaches_the_setup() -> None:
    assert tp.parse_args([]).executors == 1
    assert tp.parse_args(["--executors", "2"]).executors == 2
    assert tp.parse_args(["--report-every-steps", "8"]).report_every_steps == 8
    assert tp.parse_args([]).block_size == 16 and tp.parse_args(["--block-size", "256"]).block_size == 256
    assert tp.Setup().executors == 1


def test_repeats_report_each_ratio_and_its_median(capsys: pytest.CaptureFixture[str]) -> None:
    assert tp.parse_args([]).repeats == 1
    assert (tp.parse_args([]).short_warmup, tp.parse_args(["--short-warmup"]).short_warmup) == (False, True)
    assert tp.Setup().warm_workload  # every phase runs the workload once, untimed, by default
    repeats: list[dict[str, float | None]] = [
        {"a/b": 0.9, "a/c": 3.5},
        {"a/b": 0.7, "a/c": None},
        {"a/b": 1.0, "a/c": 4.5},
    ]
    assert tp.median_ratios(repeats) == {"a/b": 0.9, "a/c": 4.0}  # a repeat without a figure is left out
    tp.print_repeats("tiny", repeats)
    out = capsys.readouterr().out
    assert "median a/b = 0.900 over 0.900 0.700 1.000  (Baton end to end over its engine alone" in out
    assert "median a/c = 4.000 over 3.500 n/a 4.500  (Baton end to end over HF generate" in out
    with pytest.raises(SystemExit):
        tp.parse_args(["--repeats", "0"])


def test_rpc_flag_reaches_the_setup() -> None:
    assert tp.parse_args([]).rpc == "generate"
    assert tp.parse_args(["--rpc", "batch"]).rpc == "batch"
    assert tp.parse_args([]).request_stream_interval == 0
    assert tp.parse_args(["--request-stream-interval", "8"]).request_stream_interval == 8
    with pytest.raises(SystemExit):
        tp.parse_args(["--rpc", "carrier-pigeon"])


async def test_the_client_gets_the_same_greedy_outputs_over_either_rpc(redis_url: str, tiny_model_dir: Path) -> None:
    stack = await start_stack(stack_config(redis_url, tiny_model_dir))
    try:
        wl = tp.make_workload(4, 3)
        pids = {"client": os.getpid()}
        per_request = await e2e.drive_grpc(stack.target, wl, pids, "generate")
        batched = await e2e.drive_grpc(stack.target, wl, pids, "batch")
        chunked = await e2e.drive_grpc(stack.target, wl, pids, "batch", 4)
        assert chunked.outputs == per_request.outputs
        assert batched.outputs is not None
        assert [len(o) for o in batched.outputs] == wl.max_tokens
        assert batched.outputs == per_request.outputs
        assert "GenerateBatch" in batched.label and batched.tok_s and batched.tok_s > 0
        with pytest.raises(ValueError):
            await e2e.drive_grpc(stack.target, wl, pids, "smoke-signals")
    finally:
        await stack.stop()


def test_device_watch_summarises_its_samples() -> None:
    readings = iter([{"util_pct": 50.0, "memory_bytes": 2.0**30, "power_w": 100.0}] * 1000)
    with watch.DeviceWatch(lambda: next(readings), interval_s=0.005) as w:
        deadline = time.monotonic() + 10
        while len(w._samples) < 2 and time.monotonic() < deadline:  # two samples taken, however slow the machine
            time.sleep(0.005)
    summary = w.summary()
    assert summary is not None
    assert summary["samples"] >= 2
    assert summary["util_pct_mean"] == 50.0 and summary["memory_gib_max"] == 1.0 and summary["power_w_max"] == 100.0


def test_engine_phase_runs_the_workload(tiny_model_dir: Path) -> None:
    wl = tp.make_workload(3, 5)
    threads = torch.get_num_threads()
    result = tp.run_engine(tiny_model_dir, wl, 64, tp.Setup(max_batch=2, token_budget=128))
    assert torch.get_num_threads() == threads  # restored for the HF phases
    assert result.useful_tokens == sum(wl.max_tokens) and result.tok_s and result.tok_s > 0
    assert result.outputs is not None
    assert [len(o) for o in result.outputs] == wl.max_tokens
    assert "torch threads" in result.note and "CPU seconds" in result.note


def test_engine_phase_in_two_processes_gives_the_same_outputs(tiny_model_dir: Path) -> None:
    wl = tp.make_workload(3, 5)
    setup = tp.Setup(max_batch=2, token_budget=128)
    alone = tp.run_engine(tiny_model_dir, wl, 64, setup)
    split = tp.run_engine(tiny_model_dir, wl, 64, tp.Setup(max_batch=2, token_budget=128, engine_processes=2))
    assert split.outputs == alone.outputs
    assert "x2 processes" in split.label and split.tok_s and split.tok_s > 0
    assert "2 engine processes" in split.note
    assert tp.parse_args(["--engine-processes", "2"]).engine_processes == 2
    with pytest.raises(ValueError):
        tp.run_engine(tiny_model_dir, wl, 64, tp.Setup(engine_processes=0))


def test_metrics_reader_reads_the_executor_gauges() -> None:
    from common.metrics import serve_metrics
    from executor_service.metrics import ExecutorMetrics
    from tests.conftest import free_port

    metrics = ExecutorMetrics()
    metrics.gpu_util.set(87.5)
    metrics.gpu_memory.set(3 * 2**30)
    metrics.gpu_power.set(412.0)
    port = serve_metrics(metrics.registry, free_port(), host="127.0.0.1")
    assert watch.metrics_reader(port)() == {"util_pct": 87.5, "memory_bytes": 3 * 2**30, "power_w": 412.0}
