"""Random plans (admits, aborts, plan preemptions, re-admissions) against an overlapped
engine, checked for the invariants the scheduler relies on and for greedy exactness."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from common.lifecycle import FinishReason
from common.sampling_params import SamplingParams
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, PlanUpdate
from tests.executor_service.test_engine import make_engine, prompts

STATS = {"overlapped": 0, "kv_preempted": 0}
_REF: dict[tuple[tuple[int, ...], SamplingParams], tuple[list[int], FinishReason]] = {}


def alone(ref: Engine, prompt: tuple[int, ...], params: SamplingParams) -> tuple[list[int], FinishReason]:
    key = (prompt, params)
    if key not in _REF:
        ref.apply(PlanUpdate(seq=ref.plan_seq + 1, admit=(AdmitSpec("ref", prompt, (), params, 0.0),)))
        tokens: list[int] = []
        reason = None
        while reason is None:
            out = ref.step() if ref.has_work else ref.drain()
            tokens += [t for d in out.tokens for t in d.token_ids]
            for f in out.finished:
                reason = f.reason
        while ref.has_work:
            ref.step()
        _REF[key] = (tokens, reason)
    return _REF[key]


def run_fuzz(engine: Engine, ref: Engine, seed: int, steps: int = 160) -> None:
    rng = random.Random(seed)
    pool = [tuple(p) for p in prompts(6, seed=seed)]
    # Prompts that share a prefix (whole blocks and a part of one) with different tails: admitted in
    # one plan, the later ones start from blocks the first fills in the same step.
    base = max(pool, key=len)
    pool += [base[: len(base) * k // 4] + tail for k, tail in ((2, (7, 8, 9)), (3, (10, 11)), (3, (12,) * 20))]
    probe = {p: alone(ref, p, SamplingParams(max_tokens=24, ignore_eos=True))[0] for p in pool}
    live: dict[str, tuple[tuple[int, ...], SamplingParams]] = {}  # admitted, not finished / preempted
    handed_back: dict[str, tuple[tuple[int, ...], SamplingParams]] = {}  # preempted, to re-admit
    got: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    specs: dict[str, tuple[tuple[int, ...], SamplingParams]] = {}
    plan_seq = 0
    counter = 0
    for step in range(steps):
        admit: list[AdmitSpec] = []
        abort: list[str] = []
        preempt: list[str] = []
        before = set(live)
        if step < steps - 60 and rng.random() < (0.9 if (step // 15) % 3 == 0 else 0.02):
            prompt = rng.choice(pool)
            kind = rng.randrange(4)
            if kind == 0:
                params = SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True)
            elif kind == 1:
                params = SamplingParams(
                    max_tokens=20, ignore_eos=True, stop_token_ids=(probe[prompt][rng.randrange(0, 6)],)
                )
            elif kind == 2:
                params = SamplingParams(max_tokens=rng.randrange(1, 20))
            else:
                params = SamplingParams(max_tokens=20, ignore_eos=True, stop=("e", "a"))
            rid = f"r{counter}"
            counter += 1
            specs[rid] = (prompt, params)
            live[rid] = (prompt, params)
            admit.append(AdmitSpec(rid, prompt, (), params, float(counter)))
        if before and rng.random() < 0.05:
            abort.append(rng.choice(sorted(before)))
        if before and rng.random() < 0.08:
            victim = rng.choice(sorted(before - set(abort)) or [""])
            if victim:
                preempt.append(victim)
                handed_back[victim] = live.pop(victim)
        if before and rng.random() < 0.05:  # the scheduler re-admits a running request with what it recorded
            rid = rng.choice(sorted(before - set(abort) - set(preempt)) or [""])
            if rid:
                prompt, params = live[rid]
                admit.append(AdmitSpec(rid, prompt, tuple(got.get(rid, [])), params, 0.5))
        if set(handed_back) - set(preempt) and rng.random() < 0.3:
            rid = rng.choice(sorted(set(handed_back) - set(preempt)))
            prompt, params = handed_back.pop(rid)
            live[rid] = (prompt, params)
            admit.append(AdmitSpec(rid, prompt, tuple(got.get(rid, [])), params, 0.5))
        for rid in abort:
            live.pop(rid, None)
        if admit or abort or preempt:
            plan_seq += 1
            engine.apply(PlanUpdate(seq=plan_seq, admit=tuple(admit), abort=tuple(abort), preempt=tuple(preempt)))
        out = engine.step() if engine.has_work else engine.drain()
        STATS["overlapped"] += engine._pending is not None
        STATS["kv_preempted"] += len(set(out.preempted) - set(preempt))
        seen = set()
        for delta in out.tokens:
            rid = delta.request_id
            assert rid not in seen
            seen.add(rid)
            assert rid not in finished, f"{rid}: tokens after its finish"
            assert delta.output_index == len(got.get(rid, [])), f"{rid}: out of order at step {step}"
            got.setdefault(rid, []).extend(delta.token_ids)
        for f in out.finished:
            assert f.request_id not in finished, f"{f.request_id} finished twice"
            finished[f.request_id] = f.reason
            live.pop(f.request_id, None)
        for rid in out.preempted:
            if rid in live and rid not in preempt:
                handed_back[rid] = live.pop(rid)
        for rid in (r.request_id for r in out.rejected):
            if rid in live:
                handed_back[rid] = live.pop(rid)
    # Let everything left run out.
    for rid, (prompt, params) in handed_back.items():
        plan_seq += 1
        engine.apply(PlanUpdate(seq=plan_seq, admit=(AdmitSpec(rid, prompt, tuple(got.get(rid, [])), params, 0.5),)))
        live[rid] = (prompt, params)
    handed_back = {}
    for _ in range(400):
        if not engine.has_work and not engine.has_news:
            break
        out = engine.step() if engine.has_work else engine.drain()
        for delta in out.tokens:
            rid = delta.request_id
            assert rid not in finished
            assert delta.output_index == len(got.get(rid, []))
            got.setdefault(rid, []).extend(delta.token_ids)
        for f in out.finished:
            assert f.request_id not in finished
            finished[f.request_id] = f.reason
        assert not out.preempted and not out.rejected, "small fuzz end: nothing handed back"
    assert not engine.running and engine.allocator.num_used == 0
    for rid, reason in finished.items():
        prompt, params = specs[rid]
        ref_tokens, ref_reason = alone(ref, prompt, params)
        if reason is FinishReason.CANCELLED:
            assert got.get(rid, []) == ref_tokens[: len(got.get(rid, []))], rid
        else:
            assert (got.get(rid, []), reason) == (ref_tokens, ref_reason), rid


@pytest.mark.parametrize("overlap", ["on", "off"])
@pytest.mark.parametrize("seed", range(4))
def test_random_plans_keep_outputs_exact(tiny_model_dir: Path, overlap: str, seed: int) -> None:
    engine = make_engine(tiny_model_dir, async_scheduling=overlap, kv_cache_memory_mb=2, token_budget=256)
    ref = make_engine(tiny_model_dir, async_scheduling="off")
    before = STATS["overlapped"]
    run_fuzz(engine, ref, seed)
    assert overlap == "off" or STATS["overlapped"] > before + 20, "the fuzz exercises overlapped steps"
