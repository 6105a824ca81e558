"""bench/sim_executor.py: the simulated executor follows the engine's rules and the real protocol.

These test the simulator itself (a benchmark tool); no test uses it in place of the real engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench import sim_engine, sim_executor
from common.config_loading import with_overrides
from common.lifecycle import FinishReason
from common.pb import executor_pb2 as epb
from common.pb import generate_pb2 as pb
from common.pb.generate_pb2_grpc import GenerationStub
from scheduler_service.server import start_scheduler
from tests.stack import stack_config


def admit(request_id: str, prompt: int, max_tokens: int, rank: float = 0.0) -> epb.AdmitRequest:
    return epb.AdmitRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt + 1)),
        sampling=epb.ExecSampling(max_tokens=max_tokens, ignore_eos=True),
        rank=rank,
    )


def run_until_idle(engine: Any) -> list[Any]:
    reports = []
    while engine.has_work:
        reports.append(engine.step(1000))
    return reports


def test_engine_emits_one_token_per_step_and_finishes_at_max_tokens() -> None:
    engine = sim_engine.SimEngine(sim_engine.SimConfig(max_batch_size=4, token_budget=64))
    engine.apply(epb.Plan(seq=1, admit=[admit("a", 10, 3), admit("b", 5, 1)]))
    first = engine.step(1000)
    assert first.plan_seq == 1 and first.iteration == 1
    assert [(d.request_id, d.index) for d in first.tokens] == [("a", 0), ("b", 0)]  # both prefills fit
    assert [f.request_id for f in first.finished] == ["b"]
    assert first.finished[0].finish_reason == FinishReason.LENGTH
    rest = run_until_idle(engine)
    assert [[d.index for d in r.tokens] for r in rest] == [[1], [2]]
    assert rest[-1].finished[0].request_id == "a" and rest[-1].load.num_running == 0


def test_engine_chunks_prefill_by_grant_and_budget() -> None:
    engine = sim_engine.SimEngine(sim_engine.SimConfig(token_budget=8))
    engine.apply(epb.Plan(seq=1, admit=[admit("a", 20, 2)], prefill=[epb.PrefillGrant(request_id="a", num_tokens=5)]))
    steps = [engine.step(0) for _ in range(3)]
    assert [r.load.num_tokens for r in steps] == [5, 8, 7]  # grant, then the budget, then the rest + first token
    assert [len(r.tokens) for r in steps] == [0, 0, 1]


def test_engine_rejects_when_full_and_reports_aborts_and_preempts() -> None:
    engine = sim_engine.SimEngine(sim_engine.SimConfig(max_batch_size=1))
    engine.apply(epb.Plan(seq=1, admit=[admit("a", 4, 9), admit("b", 4, 9)]))
    report = engine.drain()
    assert [(r.request_id, r.error) for r in report.rejected] == [("b", "batch full")]
    engine.apply(epb.Plan(seq=2, admit=[admit("c", 5000, 1)]))
    assert engine.drain().finished[0].finish_reason == FinishReason.ERROR  # longer than max_model_len
    engine.apply(epb.Plan(seq=3, abort=["a"]))
    assert engine.drain().finished[0].finish_reason == FinishReason.CANCELLED
    engine.apply(epb.Plan(seq=4, admit=[admit("d", 4, 9)]))
    engine.apply(epb.Plan(seq=5, preempt=["d"]))
    out = engine.drain()
    assert list(out.preempted) == ["d"] and out.plan_seq == 5 and not engine.has_news


def test_engine_resumes_after_the_tokens_it_was_given() -> None:
    engine = sim_engine.SimEngine(sim_engine.SimConfig())
    resumed = admit("a", 4, 3)
    resumed.output_token_ids.extend([7, 8])
    engine.apply(epb.Plan(seq=1, admit=[resumed]))
    (report,) = run_until_idle(engine)
    assert [d.index for d in report.tokens] == [2] and report.finished[0].request_id == "a"


def test_engine_preempts_the_least_important_when_blocks_run_out() -> None:
    # 4 blocks of 16 tokens: both 30-token prompts fit, but only one can grow to 60.
    engine = sim_engine.SimEngine(sim_engine.SimConfig(kv_blocks_total=4, block_size=16, max_model_len=64))
    engine.apply(epb.Plan(seq=1, admit=[admit("a", 30, 30, rank=0.0), admit("b", 30, 30, rank=1.0)]))
    reports = run_until_idle(engine)
    assert [p for r in reports for p in r.preempted] == ["b"]
    assert [f.request_id for r in reports for f in r.finished] == ["a"]
    # a's whole output, and b's first three tokens: at 33 tokens a needs a third block, and b holds the last two
    assert sum(len(r.tokens) for r in reports) == 30 + 3
    assert all(r.load.kv_blocks_used <= 4 for r in reports) and engine.allocator.num_used == 0


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        sim_engine.SimConfig(step_s=0)
    with pytest.raises(ValueError):
        sim_engine.SimConfig(token_budget=1)


@pytest.fixture
async def sims_and_scheduler(redis_url: str, tiny_model_dir: Path) -> AsyncIterator[tuple[list[Any], str]]:
    config = with_overrides(stack_config(redis_url, tiny_model_dir), scheduler={"tokenizer": str(tiny_model_dir)})
    sim_config = sim_engine.SimConfig(step_s=0.005, max_batch_size=4, heartbeat_ms=200)
    sims = [await sim_executor.start_sim(f"sim-{i}", redis_url, sim_config) for i in range(2)]
    scheduler = await start_scheduler(config)
    yield sims, f"127.0.0.1:{scheduler.port}"
    await scheduler.stop(grace=0.5)
    for s in sims:
        await s.stop()


async def test_a_real_scheduler_drives_simulated_executors(sims_and_scheduler: tuple[list[Any], str]) -> None:
    import grpc

    sims, target = sims_and_scheduler
    async with grpc.aio.insecure_channel(target) as channel:
        stub = GenerationStub(channel)
        deadline = asyncio.get_running_loop().time() + 30

        async def one(i: int) -> pb.CompleteResponse:
            request = pb.GenerateRequest(
                prompt_token_ids=[1, 5 + i, 6, 7], params=pb.SamplingParams(max_tokens=5 + i % 3, ignore_eos=True)
            )
            while True:
                try:
                    return await stub.Complete(request, timeout=30)
                except grpc.aio.AioRpcError as exc:  # UNAVAILABLE until the scheduler attached the sims
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.1)

        replies = await asyncio.gather(*(one(i) for i in range(12)))
    for i, reply in enumerate(replies):
        assert len(reply.token_ids) == 5 + i % 3
        assert reply.finish_reason == pb.FINISH_REASON_LENGTH
    stats = sim_executor.snapshot(sims)
    assert stats["count"] == 2 and stats["admitted"] >= 12 and stats["tokens"] >= sum(5 + i % 3 for i in range(12))
    assert stats["plans"] > 0 and all(0 < x < 30 for x in stats["plan_latency_s"])
