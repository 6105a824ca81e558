"""Log probabilities from the engine on the generated tiny model, against ``log_softmax`` of the
model's own logits: generated tokens' and the prompt's, batched, chunked, cached and resumed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import GenerationMixin

from common.lifecycle import FinishReason
from common.logprobs import Logprobs
from common.pb import executor_pb2 as pb
from common.sampling_params import SamplingParams
from executor_service.convert import report_to_pb
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, FinishOut, PlanUpdate, StepOutput, TokenOut
from executor_service.load_metrics import DeviceLoad
from tests.executor_service.reference import load_reference_model
from tests.executor_service.test_engine import admit, make_engine, prompts

TOLERANCE = 1e-4


@torch.inference_mode()
def model_logprobs(model: GenerationMixin, tokens: list[int]) -> torch.Tensor:
    """log_softmax of ``model(tokens)``'s logits in float32, [len(tokens), vocab]: row q predicts token q + 1."""
    logits = model(torch.tensor([tokens])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)


def collect(engine: Engine, specs: list[AdmitSpec]) -> tuple[dict[str, list[TokenOut]], dict[str, FinishOut]]:
    engine.apply(PlanUpdate(seq=engine.plan_seq + 1, admit=tuple(specs)))
    outs: dict[str, list[TokenOut]] = {s.request_id: [] for s in specs}
    finished: dict[str, FinishOut] = {}
    while engine.has_work:
        out = engine.step()
        for delta in out.tokens:
            outs[delta.request_id].append(delta)
        finished.update((f.request_id, f) for f in out.finished)
    finished.update((f.request_id, f) for f in engine.drain().finished)
    return outs, finished


def joined(outs: list[TokenOut]) -> tuple[list[int], Logprobs | None]:
    tokens = [t for o in outs for t in o.token_ids]
    logprobs: Logprobs | None = None
    for o in outs:
        if o.logprobs is not None:
            logprobs = o.logprobs if logprobs is None else logprobs.then(o.logprobs)
    return tokens, logprobs


def assert_positions(got: Logprobs, expected: torch.Tensor, tokens: list[int], num_top: int) -> None:
    """Position i of ``got`` is token ``tokens[i]`` scored by row i of ``expected`` (log-softmaxed)."""
    assert list(got.token_ids) == tokens and got.num_top == num_top
    want = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert got.logprobs == pytest.approx(want.tolist(), abs=TOLERANCE)
    # vLLM's rank: how many tokens are at least as likely; tokens within the tolerance may fall either side.
    surely_above = (expected > want[:, None] + TOLERANCE).sum(dim=-1)
    maybe_above = (expected >= want[:, None] - TOLERANCE).sum(dim=-1)
    for rank, low, high in zip(got.ranks, surely_above.tolist(), maybe_above.tolist(), strict=True):
        assert low + 1 <= rank <= high
    if num_top:
        top = torch.topk(expected, num_top, dim=-1)
        for i in range(len(tokens)):
            ids, values = zip(*got.top(i), strict=True)
            assert list(values) == pytest.approx(top.values[i].tolist(), abs=TOLERANCE)
            # Ties within the tolerance may come in either order; the values above pin them.
            for token, value in zip(ids, values, strict=True):
                assert float(expected[i, token]) == pytest.approx(value, abs=TOLERANCE)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> GenerationMixin:
    return load_reference_model(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return make_engine(tiny_model_dir, token_budget=48)  # prompts over 48 tokens prefill in chunks


def test_greedy_logprobs_are_the_models_in_a_mixed_batch(engine: Engine, model: GenerationMixin) -> None:
    batch = prompts(5, seed=31)
    counts = [5, None, 0, 20, None]
    specs = [
        AdmitSpec(f"l{i}", tuple(p), (), SamplingParams(max_tokens=12, ignore_eos=True, logprobs=k), 0.0)
        for i, (p, k) in enumerate(zip(batch, counts, strict=True))
    ]
    outs, _ = collect(engine, specs)
    for spec, prompt, k in zip(specs, batch, counts, strict=True):
        tokens, logprobs = joined(outs[spec.request_id])
        if k is None:
            assert logprobs is None and all(o.prompt_logprobs is None for o in outs[spec.request_id])
            continue
        assert logprobs is not None
        expected = model_logprobs(model, prompt + tokens)[len(prompt) - 1 : -1]
        assert_positions(logprobs, expected, tokens, k)
        assert tokens == expected.argmax(dim=-1).tolist()  # greedy: the most likely token every time


@pytest.mark.parametrize("backend", ["cpu_native", "cpu_transformers", "torch"])
def test_prompt_logprobs_are_the_models_whole_and_chunked(
    tiny_model_dir: Path, model: GenerationMixin, backend: str
) -> None:
    """Every backend keeps the logits of the rows asked for: the lean Llama forward, transformers' own."""
    engine = make_engine(tiny_model_dir, token_budget=48, backend=backend)
    long, short = prompts(12, seed=32)[:2]
    long = long + [7] * 120  # prefilled over several steps of 48 tokens
    specs = [
        AdmitSpec("long", tuple(long), (), SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=4), 0.0),
        AdmitSpec("short", tuple(short), (), SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0), 0.0),
        admit("plain", prompts(1, seed=33)[0], 3),
    ]
    outs, _ = collect(engine, specs)
    for name, prompt, k in (("long", long, 4), ("short", short, 0)):
        first = outs[name][0]
        assert first.output_index == 0 and first.prompt_logprobs is not None
        assert all(o.prompt_logprobs is None for o in outs[name][1:])
        got = first.prompt_logprobs
        assert len(got) == len(prompt) and got.token_ids[0] == prompt[0] and not got.predicted(0)
        assert math.isnan(got.logprobs[0])
        assert_positions(got.slice(1), model_logprobs(model, prompt)[:-1], prompt[1:], k)
    assert outs["plain"][0].prompt_logprobs is None


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, block_size=16)
    prompt = [1, *prompts(1, seed=34)[0], *range(100, 160)]
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    first, _ = collect(engine, [AdmitSpec("a", tuple(prompt), (), params, 0.0)])
    hits = engine.prefix_cache.hits
    again, _ = collect(engine, [AdmitSpec("b", tuple(prompt), (), params, 0.0)])
    assert engine.prefix_cache.hits == hits  # computed again, all of it
    assert again["b"][0].prompt_logprobs == first["a"][0].prompt_logprobs
    assert engine.allocator.num_cached > 0  # its blocks are still cached for others
    collect(engine, [admit("c", prompt, 2)])
    assert engine.prefix_cache.hits > hits


def test_max_tokens_zero_scores_the_prompt_only(engine: Engine, model: GenerationMixin) -> None:
    prompt = prompts(1, seed=35)[0]
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    outs, finished = collect(engine, [AdmitSpec("score", tuple(prompt), (), params, 0.0), admit("beside", prompt, 4)])
    [only] = outs["score"]
    assert only.token_ids == () and only.output_index == 0 and only.logprobs is None
    assert only.prompt_logprobs is not None and len(only.prompt_logprobs) == len(prompt)
    assert_positions(only.prompt_logprobs.slice(1), model_logprobs(model, prompt)[:-1], prompt[1:], 2)
    assert finished["score"].reason is FinishReason.LENGTH
    assert len(joined(outs["beside"])[0]) == 4
    assert engine.allocator.num_used == 0


def test_resumed_request_continues_its_logprobs_and_skips_the_prompts(engine: Engine) -> None:
    prompt = prompts(1, seed=36)[0]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    whole, _ = collect(engine, [AdmitSpec("w", tuple(prompt), (), params, 0.0)])
    tokens, logprobs = joined(whole["w"])
    resumed, _ = collect(engine, [AdmitSpec("r", tuple(prompt), tuple(tokens[:4]), params, 0.0)])
    rest, rest_logprobs = joined(resumed["r"])
    assert rest == tokens[4:] and resumed["r"][0].output_index == 4
    assert all(o.prompt_logprobs is None for o in resumed["r"])  # delivered before the resume
    assert logprobs is not None and rest_logprobs is not None
    assert rest_logprobs.logprobs == pytest.approx(logprobs.slice(4).logprobs, abs=TOLERANCE)


def test_report_carries_logprobs_only_for_requests_that_asked() -> None:
    lp = Logprobs.build([5], [-0.25], [[5, 6]], [[-0.25, -2.0]])
    tokens = (TokenOut("asked", (5,), "x", 0, lp, lp), TokenOut("plain", (9,), "y", 0))
    step = StepOutput(1, 1, tokens, (), (), (), 2, 1, 2, 0, 1, 0)
    device = DeviceLoad("process", 0.0, 0, 1, 0.0)
    report = pb.StepReport.FromString(report_to_pb(step, device).SerializeToString())
    asked, plain = report.tokens
    assert Logprobs.from_pb(asked.logprobs) == lp and Logprobs.from_pb(asked.prompt_logprobs) == lp
    assert not plain.HasField("logprobs") and not plain.HasField("prompt_logprobs")
    assert plain.ByteSize() == pb.TokenDelta(request_id="plain", token_ids=[9], text="y").ByteSize()
