"""Overlapped steps (``executor.async_scheduling``): a decode step launches before the last step's
tokens are read. Run on the CPU (forced on), where the device is synchronous but every path is the
one CUDA takes: the same tokens, texts and finishes as without overlap, and as ``model.generate``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.lifecycle import FinishReason
from common.sampling_params import SamplingParams
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, PlanUpdate, StepOutput
from executor_service.sampling import Sampled
from tests.executor_service.test_engine import (
    admit,
    assert_staggered_batch_exact,
    make_engine,
    prompts,
)

Outcome = dict[str, tuple[list[int], str, FinishReason]]


def run_all(engine: Engine, arrivals: dict[int, list[AdmitSpec]], max_steps: int = 3000) -> Outcome:
    """Each request's tokens, text and finish reason, with ``arrivals[step]`` admitted at that step."""
    tokens: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    reasons: dict[str, FinishReason] = {}
    expected = {spec.request_id for specs in arrivals.values() for spec in specs}
    resumed = {spec.request_id: len(spec.output_ids) for specs in arrivals.values() for spec in specs}
    for step in range(max_steps):
        if step in arrivals:
            engine.apply(PlanUpdate(seq=engine.plan_seq + 1, admit=tuple(arrivals[step])))
        out = engine.step() if engine.has_work else engine.drain()
        seen = set()
        for delta in out.tokens:
            assert delta.request_id not in seen, "one output per request per report"
            seen.add(delta.request_id)
            made = resumed[delta.request_id] + len(tokens.get(delta.request_id, []))
            assert delta.output_index == made, "tokens arrive in order"
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            text[delta.request_id] = text.get(delta.request_id, "") + delta.text
        for fin in out.finished:
            assert fin.request_id not in reasons, "one finish per request"
            reasons[fin.request_id] = fin.reason
            text[fin.request_id] = text.get(fin.request_id, "") + fin.text
        if set(reasons) == expected and not engine.has_work:
            assert engine.allocator.num_used == 0 and engine._pending is None
            return {rid: (tokens.get(rid, []), text.get(rid, ""), reasons[rid]) for rid in expected}
    raise AssertionError(f"unfinished after {max_steps} steps: {expected - set(reasons)}")


def mixed_arrivals(stop_ids: list[int], stop_texts: list[str]) -> dict[int, list[AdmitSpec]]:
    """Plain greedy decodes with length limits, stop tokens and stop strings, joined by requests that
    read tokens on the host (log probabilities, penalties, seeded sampling) while others decode."""
    rng = random.Random(3)
    specs: list[AdmitSpec] = []
    for i, prompt in enumerate(prompts(14, seed=21)):
        kind = i % 7
        params = SamplingParams(max_tokens=rng.randrange(2, 30), ignore_eos=True)
        if kind == 1:
            params = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=tuple(stop_ids))
        elif kind == 2:
            params = SamplingParams(max_tokens=30, ignore_eos=True, stop=tuple(stop_texts))
        elif kind == 3:
            params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
        elif kind == 4:
            params = SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
        elif kind == 5:
            params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=i)
        specs.append(AdmitSpec(f"m{i}", tuple(prompt), (), params, float(i)))
    arrivals: dict[int, list[AdmitSpec]] = {}
    for i, spec in enumerate(specs):
        arrivals.setdefault(i * 4, []).append(spec)  # one joins every fourth step, mid-decode
    return arrivals


def stops_from(engine: Engine) -> tuple[list[int], list[str]]:
    """Stop tokens and strings the tiny model really produces (from a plain run's output)."""
    outcome = run_all(engine, {0: [admit("probe", prompts(14, seed=21)[1], 30)]})
    probe, text, _ = outcome["probe"]
    return [probe[6]], [text[len(text) // 2 : len(text) // 2 + 2]]


def test_torch_backend_on_the_cpu_runs_without_overlap(tiny_model_dir: Path) -> None:
    # Its decodes read token ids from the host (in-place views): nothing to overlap.
    assert not make_engine(tiny_model_dir, backend="torch", async_scheduling="on").overlap
    assert not make_engine(tiny_model_dir).overlap  # auto: CUDA only
    assert make_engine(tiny_model_dir, async_scheduling="on").overlap


@pytest.mark.parametrize("static_shapes", [False, True], ids=["unpadded", "padded"])
def test_overlapped_staggered_batch_matches_generate_alone(tiny_model_dir: Path, static_shapes: bool) -> None:
    engine = make_engine(tiny_model_dir, async_scheduling="on")
    engine.runner.backend.static_shapes = static_shapes  # padded: the CUDA backend's path, eager
    assert_staggered_batch_exact(engine, tiny_model_dir)


def test_overlap_gives_the_tokens_texts_and_finishes_of_stepping_in_turn(tiny_model_dir: Path) -> None:
    stop_ids, stop_texts = stops_from(make_engine(tiny_model_dir))
    in_turn = run_all(make_engine(tiny_model_dir, async_scheduling="off"), mixed_arrivals(stop_ids, stop_texts))
    engine = make_engine(tiny_model_dir, async_scheduling="on")
    overlapped_steps = 0
    step = engine.step

    def counting_step() -> StepOutput:
        nonlocal overlapped_steps
        out = step()
        overlapped_steps += engine._pending is not None
        return out

    engine.step = counting_step  # type: ignore[method-assign]
    overlapped = run_all(engine, mixed_arrivals(stop_ids, stop_texts))
    assert overlapped == in_turn
    assert {reason for _, _, reason in in_turn.values()} >= {FinishReason.STOP, FinishReason.LENGTH}
    assert overlapped_steps > 20, "most decode steps launch before the last one's tokens are read"


def test_a_request_aborted_with_a_token_pending_gets_no_more_tokens(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, async_scheduling="on")
    engine.apply(PlanUpdate(seq=1, admit=(admit("a", prompts(1)[0], 50), admit("b", prompts(2)[1], 50))))
    while engine._pending is None:
        engine.step()
    engine.apply(PlanUpdate(seq=2, abort=("a",)))
    out = engine.step()
    assert "a" not in {t.request_id for t in out.tokens}
    assert [(f.request_id, f.reason) for f in engine.drain().finished + out.finished] == [("a", FinishReason.CANCELLED)]
    engine.apply(PlanUpdate(seq=3, abort=("b",)))
    while engine.has_work:
        engine.step()
    assert engine.allocator.num_used == 0 and engine._pending is None


def test_preemption_while_a_step_is_pending_keeps_output_exact(tiny_model_dir: Path) -> None:
    # A pool of a few blocks: decodes run out of blocks and preempt the least important, whose pending
    # token is dropped with its cache; resumed from what was reported, it ends as if uninterrupted.
    engine = make_engine(tiny_model_dir, async_scheduling="on", kv_cache_memory_mb=1, token_budget=512)
    blocks = engine.allocator.num_blocks
    prompt_len = (blocks // 2) * 16 - 20
    specs = [admit("important", [1] * prompt_len, 40, rank=0), admit("victim", [2] * prompt_len, 40, rank=1)]
    engine.apply(PlanUpdate(seq=1, admit=tuple(specs)))
    got: dict[str, list[int]] = {}
    preempted: list[str] = []
    while engine.has_work and not preempted:
        out = engine.step()
        preempted += out.preempted
        for delta in out.tokens:
            got.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert preempted == ["victim"]
    while engine.has_work:
        for delta in engine.step().tokens:
            got.setdefault(delta.request_id, []).extend(delta.token_ids)
    reference = make_engine(tiny_model_dir)
    alone = run_all(reference, {0: [specs[1]]})["victim"][0]
    resumed = AdmitSpec("victim", specs[1].prompt_ids, tuple(got.get("victim", [])), specs[1].params, 1.0)
    rest = run_all(engine, {0: [resumed]})["victim"][0]
    assert got.get("victim", []) + rest == alone


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(5, 8000) for _ in range(length - 1)]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_request_whose_pending_token_ends_it_is_not_handed_back(tiny_model_dir: Path, overlap: str) -> None:
    # X's 21st token is its stop token, still pending when Y needs a block from a full pool: the pending
    # tokens are read first, so X ends (STOP, 21 tokens) and frees its blocks instead of being preempted.
    px, py = _prompt(108, 5), _prompt(108, 1005)
    x_alone = run_all(make_engine(tiny_model_dir), {0: [admit("X", px, 21)]})["X"][0]
    stop = x_alone[20]
    assert stop not in x_alone[:20]
    params = SamplingParams(max_tokens=60, ignore_eos=True, stop_token_ids=(stop,))
    specs = [admit("Y", py, 60, rank=0), AdmitSpec("X", tuple(px), (), params, 1.0)]
    engine = make_engine(tiny_model_dir, async_scheduling=overlap, kv_cache_memory_mb=1, token_budget=512)
    engine.apply(PlanUpdate(seq=1, admit=tuple(specs)))
    made, events = 0, []
    while engine.has_work:
        out = engine.step()
        made += sum(len(t.token_ids) for t in out.tokens if t.request_id == "X")
        events += [(f.request_id, f.reason, made) for f in out.finished if f.request_id == "X"]
        assert "X" not in out.preempted
    assert events == [("X", FinishReason.STOP, 21)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_copy_to_host_waits_for_the_copy_on_the_tokens_device() -> None:
    # An executor on cuda:N does not make it the current device: the event copy_to_host records must be on
    # the stream the copy runs on (cuda:1's), not the current device's.
    device = torch.device("cuda:1")
    with torch.cuda.device(device):
        torch.cuda._sleep(2_000_000_000)  # about a second of device time ahead of the tokens
    tokens = torch.arange(5, 1029, device=device)
    sampled = Sampled(tokens, [None] * tokens.shape[0])
    sampled.copy_to_host()
    assert sampled.tokens == list(range(5, 1029))
