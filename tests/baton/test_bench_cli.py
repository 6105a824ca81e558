"""Smoke tests of ``baton bench`` and ``baton bench serve`` against a real stack, with tiny sizes."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import pytest

from baton.bench.client import RunPlan, run_conversations, run_workload
from baton.bench.multi_turn import MultiTurnSpec
from baton.bench.stats import RequestTiming, summarize
from baton.bench.workload import WorkloadSpec, arrival_offsets
from tests.conftest import RedisServer
from tests.scheduler_service.test_security import make_pki, mtls_security
from tests.stack import Stack, stack_config, start_stack


async def test_run_workload_times_every_request(stack: Stack) -> None:
    specs = WorkloadSpec(6, (4, 20), (2, 5), seed=3).build()
    plan = RunPlan(max_concurrency=3, offsets=arrival_offsets(len(specs), 50.0, 1.0, seed=3))
    done: list[RequestTiming] = []
    timings, seconds = await run_workload(stack.target, specs, plan, done.append)
    assert len(done) == len(specs) and seconds > 0
    for spec, timing in zip(specs, timings, strict=True):
        assert timing.ok, timing.error
        assert timing.output_len == spec.output_len
        assert 0 < timing.ttft <= timing.e2el
    summary = summarize(timings, seconds, {"ttft": 60_000})
    assert summary.completed == 6 and summary.failed == 0 and summary.short_requests == 0
    assert summary.output_tokens == sum(s.output_len for s in specs)
    assert summary.request_goodput == pytest.approx(6 / seconds)
    for value in (summary.output_throughput, summary.ttft.p99, summary.tpot.p50, summary.itl.p90, summary.e2el.mean):
        assert math.isfinite(value) and value > 0


async def _baton(*argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton.cli", *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode()


async def test_bench_prints_a_table_and_writes_json(stack: Stack, tmp_path: Path) -> None:
    result = tmp_path / "bench.json"
    argv = ["bench", "--target", stack.target, "--scenario", "short", "--num-requests", "4", "--batch-size", "2"]
    code, out = await _baton(*argv, "--output-len", "3", "--no-progress", "--json", str(result))
    assert code == 0, out
    assert "output tok/s" in out and "TTFT p99 ms" in out and "short" in out
    (row,) = json.loads(result.read_text())["results"]
    assert row["name"] == "short" and row["summary"]["completed"] == 4
    assert row["summary"]["total_output_tokens"] == 12 and row["summary"]["output_throughput"] > 0


async def test_bench_serve_saves_vllm_style_results(stack: Stack, tmp_path: Path) -> None:
    argv = ["bench", "serve", "--target", stack.target, "--num-prompts", "5", "--input-len", "8", "--output-len", "4"]
    argv += ["--request-rate", "20", "--burstiness", "0.5", "--max-concurrency", "3", "--goodput", "ttft:60000"]
    code, out = await _baton(*argv, "--no-progress", "--save-result", "--result-dir", str(tmp_path))
    assert code == 0, out
    assert "Serving Benchmark Result" in out and "P99 ITL (ms):" in out
    (saved,) = tmp_path.glob("baton-bench-serve-*.json")
    data = json.loads(saved.read_text())
    assert data["completed"] == 5 and data["failed"] == 0 and data["total_output_tokens"] == 20
    assert data["request_rate"] == 20 and data["burstiness"] == 0.5 and data["max_concurrency"] == 3
    assert data["request_goodput"] > 0 and data["p99_ttft_ms"] >= data["median_ttft_ms"] > 0


async def test_conversations_resend_the_history_with_the_real_answers(stack: Stack) -> None:
    conversations = MultiTurnSpec(conversations=2, turns=3, user_len=(3, 6), output_len=(2, 4), seed=4).build()
    by_conversation, seconds = await run_conversations(stack.target, conversations, RunPlan(max_concurrency=2))
    assert seconds > 0
    for conv, timings in zip(conversations, by_conversation, strict=True):
        assert [t.output_len for t in timings] == list(conv.output_lens)
        assert all(t.ok for t in timings), [t.error for t in timings]
        expected = 0
        for turn, timing in enumerate(timings):
            expected += len(conv.messages[turn])
            assert timing.prompt_len == expected, "the prompt is every earlier message and answer, then the new one"
            expected += conv.output_lens[turn]


async def test_bench_prefix_scenarios_report_first_and_repeat_ttft(stack: Stack, tmp_path: Path) -> None:
    result = tmp_path / "bench.json"
    argv = ["bench", "--target", stack.target, "--scenario", "shared-prefix", "multi-turn", "--batch-size", "2"]
    argv += ["--gsp-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "32"]
    argv += ["--gsp-question-len", "4", "8", "--gsp-output-len", "3"]
    argv += ["--mt-conversations", "2", "--mt-turns", "3", "--mt-user-len", "4", "8", "--mt-output-len", "3"]
    code, out = await _baton(*argv, "--no-progress", "--json", str(result))
    assert code == 0, out
    assert "repeat/first" in out and "TTFT by turn" in out and "turn 3" in out
    shared, multi = json.loads(result.read_text())["results"]
    assert shared["name"] == "shared-prefix" and shared["summary"]["completed"] == 6
    assert shared["reuse"]["firsts"] == 2 and shared["reuse"]["repeats"] == 4 and shared["reuse"]["ratio"] > 0
    # The repeats read their groups' system prompts from the prefix cache, as their usage says.
    assert 0 < shared["summary"]["total_cached_input_tokens"] < shared["summary"]["total_input_tokens"]
    assert "prompt cached" in out
    assert multi["name"] == "multi-turn" and multi["summary"]["completed"] == 6
    assert multi["reuse"]["firsts"] == 2 and len(multi["ttft_by_turn"]) == 3


async def test_bench_dials_a_scheduler_on_mtls_with_a_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The warm-up request carries the token too (it was refused UNAUTHENTICATED before the run).
    A Redis of its own: the module's stack runs on the shared one, and its executor would share
    this one's id."""
    redis = RedisServer(tmp_path)
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tok-alice: alice\n")
    security = {**mtls_security(pki), "auth_tokens_file": str(tokens)}
    stack = await start_stack(stack_config(redis.url, tiny_model_dir, security=security))
    try:
        argv = ["bench", "--target", stack.target, "--scenario", "short", "--num-requests", "2", "--output-len", "2"]
        tls = ["--tls-ca", str(pki["ca"]), "--tls-cert", str(pki["client_cert"]), "--tls-key", str(pki["client_key"])]
        code, out = await _baton(*argv, *tls, "--token", "tok-alice", "--no-progress")
        assert code == 0, out
        assert "short" in out
        code, out = await _baton(*argv, *tls, "--no-progress")  # no token: every request refused
        assert code != 0 and "UNAUTHENTICATED" in out
    finally:
        await stack.stop()
        redis.stop()
