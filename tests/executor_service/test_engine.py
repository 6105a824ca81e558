"""Engine-level tests on the generated tiny model: exact batching, chunked prefill, preemption."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.config import ExecutorConfig
from common.lifecycle import FinishReason
from common.pb import executor_pb2 as pb
from common.sampling_params import SamplingParams
from executor_service.backends.base import DecodeRead
from executor_service.backends.cpu_native import CpuNativeBackend
from executor_service.convert import plan_from_pb
from executor_service.cpu_threads import ThreadGovernor
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, FinishOut, PlanUpdate, StepOutput
from executor_service.model_loader import load_engine
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy


def make_engine(model_dir: Path, **overrides: object) -> Engine:
    settings: dict[str, object] = {"model": str(model_dir), "kv_cache_memory_mb": 16, "token_budget": 96}
    settings.update(overrides)
    return load_engine(ExecutorConfig(**settings)).engine  # type: ignore[arg-type]


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, 8000) for _ in range(rng.randrange(3, 180))] for _ in range(count)]


def admit(request_id: str, prompt: list[int], max_tokens: int, rank: float = 0.0) -> AdmitSpec:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return AdmitSpec(request_id, tuple(prompt), (), params, rank)


def run_to_end(engine: Engine, arrivals: dict[int, list[AdmitSpec]], max_steps: int = 5000) -> dict[str, list[int]]:
    """Step the engine, admitting ``arrivals[step]`` at each step; collect tokens per request."""
    outputs: dict[str, list[int]] = {}
    done: set[str] = set()
    expected = {spec.request_id for specs in arrivals.values() for spec in specs}
    seq = 0
    for step in range(max_steps):
        if step in arrivals:
            seq += 1
            engine.apply(PlanUpdate(seq=seq, admit=tuple(arrivals[step])))
        out: StepOutput = engine.step() if engine.has_work else engine.drain()
        for delta in out.tokens:
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        done.update(f.request_id for f in out.finished)
        if done == expected:
            return outputs
    raise AssertionError(f"unfinished after {max_steps} steps: {expected - done}")


@pytest.mark.parametrize(
    "kv_read",
    [
        "native",
        "native_scattered",
        "hf_forward",
        "in_place",
        "layer_ops_in_place",
        "gathered",
        "scattered",
        "paged",
        "paged_scattered",
        "torch_only",
    ],
)
def test_staggered_batch_matches_generate_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, kv_read: str
) -> None:
    """Every way attention reads the cache gives the same tokens: the native paged kernel (CPU
    decodes, with the native layer ops for norms, RoPE and SiLU), views of contiguous blocks (CPU
    without it), one gathered batch (CUDA decodes), and blocks scattered over the pool.
    ``hf_forward``: transformers' forward instead of the lean Llama one (the cpu_transformers
    backend); ``layer_ops_in_place``: the native layer ops writing the K/V that torch's in-place
    views then read; ``paged``: whole block tables and lengths, as the CUDA backend's in-place
    kernel reads them (computed here by its gathered oracle); ``torch_only``: the reference backend
    (no native kernel, no packed linears, no lean forward)."""
    backend = {"hf_forward": "cpu_transformers", "torch_only": "torch"}.get(kv_read, "cpu_native")
    engine = make_engine(tiny_model_dir, backend=backend)
    expected = DecodeRead.IN_PLACE if kv_read == "torch_only" else DecodeRead.NATIVE
    assert engine.runner.decode_read is expected, "the native decode kernel did not build here"
    if kv_read not in ("native", "native_scattered", "hf_forward", "torch_only"):
        monkeypatch.setattr(engine.runner, "decode_read", DecodeRead.IN_PLACE)
        if kv_read != "layer_ops_in_place":
            assert isinstance(engine.runner.backend, CpuNativeBackend)
            monkeypatch.setattr(engine.runner.backend.lean, "native_layer_ops", False)  # torch's elementwise ops
    if kv_read in ("gathered", "scattered"):
        monkeypatch.setattr(engine.runner, "decode_read", DecodeRead.GATHERED)
    if kv_read.startswith("paged"):  # the in-place kernel's tables and lengths, computed by its gathered oracle
        monkeypatch.setattr(engine.runner, "decode_read", DecodeRead.PAGED)
    if kv_read.endswith("scattered"):
        monkeypatch.setattr(engine.allocator, "contiguous_start", lambda table: None)
    assert_staggered_batch_exact(engine, tiny_model_dir)


class _Alternating(ThreadGovernor):
    """Flips between its two thread counts after every step, whatever the step's work."""

    def after_step(self, forward_seconds: float, tokens: int = 0) -> None:
        self.current = self.many if self.current == self.few else self.few


def test_thread_count_changing_between_steps_keeps_greedy_exact(tiny_model_dir: Path) -> None:
    """The CPU thread governor may change torch's thread count at any step boundary."""
    before = torch.get_num_threads()
    engine = make_engine(tiny_model_dir)
    assert engine.threads is not None  # torch_threads 0 on CPU: the governor decides
    assert make_engine(tiny_model_dir, torch_threads=1).threads is None
    engine.threads = _Alternating(2, torch.set_num_threads)  # 1, 2, 1, 2, ... threads
    try:
        assert_staggered_batch_exact(engine, tiny_model_dir)
    finally:
        torch.set_num_threads(before)


def assert_staggered_batch_exact(engine: Engine, tiny_model_dir: Path) -> None:
    reference_model = load_reference_model(tiny_model_dir)
    rng = random.Random(7)
    specs = [admit(f"r{i}", p, rng.randrange(4, 40)) for i, p in enumerate(prompts(16))]
    arrivals: dict[int, list[AdmitSpec]] = {}
    for i, spec in enumerate(specs):
        arrivals.setdefault((i // 2) * 3, []).append(spec)  # two join every third step
    outputs = run_to_end(engine, arrivals)
    for spec in specs:
        ref = reference_greedy(reference_model, list(spec.prompt_ids), spec.params.max_tokens)
        assert_matches_reference(outputs[spec.request_id], ref, spec.request_id)
    assert engine.allocator.num_used == 0


def test_chunked_prefill_respects_token_budget(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, token_budget=32)
    engine.apply(PlanUpdate(seq=1, admit=tuple(admit(f"c{i}", p, 5) for i, p in enumerate(prompts(4, seed=3)))))
    steps = 0
    while engine.has_work:
        out = engine.step()
        assert out.num_tokens <= 32
        steps += 1
    assert steps > 4  # the prompts could not have been prefilled in one step


@pytest.mark.parametrize("decode_read", [DecodeRead.NATIVE, DecodeRead.GATHERED, DecodeRead.PAGED])
def test_one_token_chunks_of_a_prompt_attend_only_to_what_is_computed(
    tiny_model_dir: Path, decode_read: DecodeRead
) -> None:
    """A one-token prefill chunk that does not complete its prompt (a grant of 1, or a step's last
    token of budget) reads like a decode. The gathered and paged reads, CUDA's, took its context
    as the whole prompt, so it attended to positions not yet computed (what an earlier request left
    in those slots), and the wrong K/V was then shared through the prefix cache."""
    engine = make_engine(tiny_model_dir, kv_cache_memory_mb=1, block_size=8, token_budget=64)
    engine.runner.decode_read = decode_read
    rng = random.Random(3)
    run_to_end(engine, {0: [admit("junk", [1] + [rng.randrange(5, 8000) for _ in range(40)], 2)]})
    prompt = [[1] + [rng.randrange(5, 8000) for _ in range(29)] for _ in range(3)][-1]  # one where it shows
    engine.apply(PlanUpdate(seq=2, admit=(admit("r", prompt, 8),), grants={"r": 10}))
    grants, got, seq = {1: 1, 2: 1, 3: 5}, [], 2  # one-token chunks at positions 10 and 11
    for step in range(200):
        if not engine.has_work:
            break
        if step in grants:
            seq += 1
            engine.apply(PlanUpdate(seq=seq, grants={"r": grants[step]}))
        got += [t for d in engine.step().tokens for t in d.token_ids]
    again = run_to_end(engine, {0: [admit("again", prompt, 8)]})["again"]  # from the cached blocks
    reference = reference_greedy(load_reference_model(tiny_model_dir), prompt, 8)
    assert_matches_reference(got, reference, "chunked")
    assert_matches_reference(again, reference, "cached")


def test_requests_are_limited_to_what_the_kv_cache_holds(tiny_model_dir: Path) -> None:
    """The tiny model takes 4,096 positions, and 1 MB of float32 KV holds 256 tokens: a request
    longer than that could never run, and used to fail part way through its output."""
    assert make_engine(tiny_model_dir, kv_cache_memory_mb=1).limits.max_model_len == 256
    assert make_engine(tiny_model_dir, kv_cache_memory_mb=64).limits.max_model_len == 4096


def test_plan_grants_cap_prefill_chunk(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, token_budget=256)
    prompt = prompts(1, seed=4)[0] + [9] * 100
    engine.apply(PlanUpdate(seq=1, admit=(admit("g", prompt, 3),), grants={"g": 10}))
    assert engine.step().num_tokens == 10
    assert engine.step().num_tokens == min(256, len(prompt) - 10)  # later steps use the standing budget


def test_out_of_blocks_preempts_least_important(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, kv_cache_memory_mb=1, block_size=16, token_budget=512)
    blocks = engine.allocator.num_blocks
    prompt_len = (blocks // 2) * 16 - 4
    specs = [admit("important", [1] * prompt_len, 64, rank=0), admit("victim", [2] * prompt_len, 64, rank=1)]
    engine.apply(PlanUpdate(seq=1, admit=tuple(specs)))
    preempted: list[str] = []
    while engine.has_work and not preempted:
        preempted += engine.step().preempted
    assert preempted == ["victim"]
    assert "important" in engine.running


def test_abort_frees_blocks_and_reports_cancelled(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.apply(PlanUpdate(seq=1, admit=(admit("a", prompts(1)[0], 50),)))
    engine.step()
    assert engine.allocator.num_used > 0
    engine.apply(PlanUpdate(seq=2, abort=("a",)))
    out = engine.drain()
    assert [(f.request_id, f.reason) for f in out.finished] == [("a", FinishReason.CANCELLED)]
    assert engine.allocator.num_used == 0


def test_resumed_request_continues_where_it_stopped(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = prompts(1, seed=9)[0]
    whole = run_to_end(engine, {0: [admit("w", prompt, 20)]})["w"]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    resumed = AdmitSpec("w2", tuple(prompt), tuple(whole[:8]), params, 0.0)
    rest = run_to_end(engine, {0: [resumed]})["w2"]
    assert whole[:8] + rest == whole


@pytest.mark.parametrize("stop_after", [1, 3])
def test_stop_token_ids_end_the_request(tiny_model_dir: Path, stop_after: int) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = prompts(1, seed=5)[0]
    free = run_to_end(engine, {0: [admit("f", prompt, 10)]})["f"]
    stop_id = free[stop_after - 1]
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(stop_id,))
    engine.apply(PlanUpdate(seq=9, admit=(AdmitSpec("s", tuple(prompt), (), params, 0.0),)))
    finished: list[FinishOut] = []
    tokens: list[int] = []
    while engine.has_work:
        out = engine.step()
        tokens += [t for d in out.tokens for t in d.token_ids]
        finished += out.finished
    assert tokens == free[: free.index(stop_id) + 1]
    assert finished[0].reason == FinishReason.STOP
    # vLLM's stop_reason: the stop token, unless it is the tokenizer's own end-of-sequence token.
    assert finished[0].stop_reason == (None if stop_id == engine.limits.eos_token_id else stop_id)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_own_text_is_left_out_unless_asked_for(tiny_model_dir: Path, include: bool) -> None:
    """As vLLM's detokenizer: the stop token ends the output and is returned, its text is not."""
    engine = make_engine(tiny_model_dir)
    prompt = prompts(1, seed=5)[0]
    free = run_to_end(engine, {0: [admit("f", prompt, 10)]})["f"]
    at = next(i for i in range(1, len(free)) if free[i] not in free[:i])  # its first appearance ends it
    params = SamplingParams(
        max_tokens=10, ignore_eos=True, stop_token_ids=(free[at],), include_stop_str_in_output=include
    )
    engine.apply(PlanUpdate(seq=9, admit=(AdmitSpec("s", tuple(prompt), (), params, 0.0),)))
    text, tokens = "", []
    while engine.has_work:
        out = engine.step()
        text += "".join(d.text for d in out.tokens) + "".join(f.text for f in out.finished)
        tokens += [t for d in out.tokens for t in d.token_ids]
    assert tokens == free[: at + 1]
    decode = engine.tokenizer.decode  # type: ignore[attr-defined]
    assert text == decode(free[: at + 1 if include else at], skip_special_tokens=True)


def test_seeds_a_power_of_two_apart_draw_differently(tiny_model_dir: Path) -> None:
    """The per-position reseed kept 63 bits of a linear mix: seeds 2**63 apart drew the same tokens."""
    engine = make_engine(tiny_model_dir)
    prompt = prompts(1, seed=12)[0]
    outputs = []
    for i, seed in enumerate((0, 2**63, 5, 5 + 2**63)):
        params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=seed)
        outputs.append(run_to_end(engine, {0: [AdmitSpec(f"p{i}", tuple(prompt), (), params, 0.0)]})[f"p{i}"])
    assert outputs[0] != outputs[1] and outputs[2] != outputs[3]


def test_seeded_sampling_is_the_same_after_a_resume(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = prompts(1, seed=12)[0]
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=7)
    whole = run_to_end(engine, {0: [AdmitSpec("s1", tuple(prompt), (), params, 0.0)]})["s1"]
    again = run_to_end(engine, {0: [AdmitSpec("s2", tuple(prompt), (), params, 0.0)]})["s2"]
    resumed = run_to_end(engine, {0: [AdmitSpec("s3", tuple(prompt), tuple(whole[:8]), params, 0.0)]})["s3"]
    assert again == whole
    assert whole[:8] + resumed == whole


def test_every_running_decode_advances_each_step(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, token_budget=12)
    engine.apply(PlanUpdate(seq=1, admit=tuple(admit(f"d{i}", [1, 5 + i, 6], 30) for i in range(8))))
    while any(not s.is_decoding for s in engine.running.values()):
        engine.step()
    out = engine.step()
    assert sorted(t.request_id for t in out.tokens) == sorted(f"d{i}" for i in range(8))
    assert out.num_tokens == 8


def test_admission_beyond_the_token_budget_is_handed_back(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, token_budget=4)
    engine.apply(PlanUpdate(seq=1, admit=tuple(admit(f"b{i}", [1, 5, 6], 30) for i in range(5))))
    out = engine.drain()
    assert sorted(r.request_id for r in out.rejected) == ["b3", "b4"]
    assert len(engine.running) == 3


def test_readmission_restarts_from_the_recorded_tokens(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = prompts(1, seed=13)[0]
    whole = run_to_end(engine, {0: [admit("ref", prompt, 12)]})["ref"]
    engine.apply(PlanUpdate(seq=1, admit=(admit("x", prompt, 12),)))
    for _ in range(6):
        engine.step()  # "x" runs ahead of what the scheduler recorded
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    again = AdmitSpec("x", tuple(prompt), tuple(whole[:2]), params, 0.0)
    rest = run_to_end(engine, {0: [again]})["x"]
    assert rest[-10:] == whole[2:]


def test_abort_all_frees_everything_silently(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.apply(PlanUpdate(seq=1, admit=tuple(admit(f"a{i}", p, 30) for i, p in enumerate(prompts(3)))))
    engine.step()
    engine.apply(PlanUpdate(seq=0, abort_all=True))
    assert not engine.running and engine.allocator.num_used == 0
    assert engine.plan_seq == 1


def test_preempted_request_keeps_its_held_back_text(tiny_model_dir: Path) -> None:
    # A stop string holds back its length - 1 characters; handed back before they were safe, they were
    # never sent, so the resumed request sends them.
    engine = make_engine(tiny_model_dir)
    prompt = tuple(prompts(1, seed=4)[0])
    params = SamplingParams(max_tokens=20, ignore_eos=True, stop=("\x00never",))

    def collect(spec: AdmitSpec, preempt_after: int = 0) -> tuple[list[int], str]:
        engine.apply(PlanUpdate(seq=engine.plan_seq + 1, admit=(spec,)))
        tokens: list[int] = []
        text = ""
        while engine.has_work:
            out = engine.step()
            for t in out.tokens:
                tokens += t.token_ids
                text += t.text
            text += "".join(f.text for f in out.finished)
            if preempt_after and len(tokens) >= preempt_after:
                engine.apply(PlanUpdate(seq=engine.plan_seq + 1, preempt=(spec.request_id,)))
                engine.drain()
                break
        return tokens, text

    whole_tokens, whole_text = collect(AdmitSpec("a", prompt, (), params, 0.0))
    first_tokens, first_text = collect(AdmitSpec("b", prompt, (), params, 0.0), preempt_after=8)
    rest_tokens, rest_text = collect(AdmitSpec("b", prompt, tuple(first_tokens), params, 0.0))
    assert first_tokens + rest_tokens == whole_tokens
    assert first_text + rest_text == whole_text


def test_the_end_of_sequence_token_names_no_stop_reason(tiny_model_dir: Path) -> None:
    """As vLLM: only stop strings and other stop tokens are a stop_reason."""
    engine = make_engine(tiny_model_dir)
    eos = engine.limits.eos_token_id
    assert eos is not None
    params = SamplingParams(max_tokens=5, allowed_token_ids=(eos,))  # the first token is EOS
    engine.apply(PlanUpdate(seq=9, admit=(AdmitSpec("e", tuple(prompts(1)[0]), (), params, 0.0),)))
    finished: list[FinishOut] = []
    while engine.has_work:
        finished += engine.step().finished
    assert [(f.reason, f.stop_reason) for f in finished] == [(FinishReason.STOP, None)]


def test_a_stop_token_is_named_before_the_stop_string_its_own_text_completes(tiny_model_dir: Path) -> None:
    """With include_stop_str_in_output the stop token's text is pushed, and may complete a stop
    string too: vLLM checks stop tokens first, so the token is the stop_reason."""
    engine = make_engine(tiny_model_dir)
    prompt = prompts(1, seed=5)[0]
    free = run_to_end(engine, {0: [admit("f", prompt, 10)]})["f"]
    decode = engine.tokenizer.decode  # type: ignore[attr-defined]
    at = next(i for i in range(1, len(free)) if free[i] not in free[:i] and decode([free[i]]).strip())
    text = decode([free[at]])
    if text in decode(free[:at]):
        pytest.skip("the stop token's text comes earlier in the output")
    params = SamplingParams(
        max_tokens=10, ignore_eos=True, stop_token_ids=(free[at],), stop=(text,), include_stop_str_in_output=True
    )
    engine.apply(PlanUpdate(seq=9, admit=(AdmitSpec("s", tuple(prompt), (), params, 0.0),)))
    finished: list[FinishOut] = []
    while engine.has_work:
        finished += engine.step().finished
    assert [(f.reason, f.stop_reason) for f in finished] == [(FinishReason.STOP, free[at])]


def test_a_request_the_model_cannot_take_ends_alone(tiny_model_dir: Path) -> None:
    """Nothing to continue, ids past the model's embeddings, or sampling parameters that do not hold:
    that request ends with an error as the plan is applied; before, the first idled as preempted
    for ever, the second failed the step and the engine thread with it, and the third ended the
    whole Run stream (every request on it aborted)."""
    engine = make_engine(tiny_model_dir)
    plan = pb.Plan(seq=1, admit=[pb.AdmitRequest(request_id="bad-params", prompt_token_ids=[1, 2])])
    plan.admit[0].sampling.max_tokens, plan.admit[0].sampling.min_tokens = 4, 9
    refused = plan_from_pb(plan)
    assert refused.admit == () and [f.request_id for f in refused.refused] == ["bad-params"]
    engine.apply(
        replace(refused, admit=(admit("empty", [], 4), admit("outside", [1, 10**9], 4), admit("good", [1, 5], 4)))
    )
    ended = {f.request_id: f for f in engine.step().finished}
    assert {rid: f.reason for rid, f in ended.items()} == dict.fromkeys(
        ["bad-params", "empty", "outside"], FinishReason.ERROR
    )
    assert "vocabulary" in ended["outside"].error and "nothing to continue" in ended["empty"].error
    assert list(engine.running) == ["good"]


def test_plans_applied_at_one_boundary_keep_each_others_grants(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, token_budget=512)
    engine.apply(PlanUpdate(seq=1, admit=(admit("a", [1, *range(5, 69)], 2),), grants={"a": 16}))
    engine.apply(PlanUpdate(seq=2, abort=("nobody",)))  # a second plan before the step
    engine.step()
    assert engine.running["a"].num_computed == 16


def test_a_resumed_request_already_complete_ends_with_length(tiny_model_dir: Path) -> None:
    # Its output reached max_tokens, or prompt and output the context: LENGTH, as uninterrupted,
    # not "do not fit" (an error) nor "batch full" (handed back, again and again).
    engine = make_engine(tiny_model_dir, max_batch_size=1)
    engine.apply(PlanUpdate(seq=1, admit=(admit("busy", [1, 5, 6], 50),)))
    at_limit = AdmitSpec("done", (1, 5, 6), (7, 8, 9, 10), SamplingParams(max_tokens=4, ignore_eos=True), 0.0)
    context = engine.limits.max_model_len
    full = AdmitSpec("full", (1,) * (context - 2), (7, 8), SamplingParams(max_tokens=50, ignore_eos=True), 0.0)
    engine.apply(PlanUpdate(seq=2, admit=(at_limit, full)))
    ended = {f.request_id: f.reason for f in engine.step().finished}
    assert ended == {"done": FinishReason.LENGTH, "full": FinishReason.LENGTH}
