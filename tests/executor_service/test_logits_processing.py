"""allowed_token_ids, bad words, min_tokens, logit_bias and the penalties: against small reference
implementations, against Hugging Face's ``generate``, batched with other requests, and across a
resume."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, GenerationMixin

from common.lifecycle import FinishReason
from common.sampling_params import SamplingParams
from common.structured_output import StructuredKind, StructuredOutput
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, PlanUpdate
from executor_service.logits_processing import LogitsProcessing
from tests.executor_service.reference import Reference, assert_matches_reference, load_reference_model
from tests.executor_service.test_engine import make_engine, prompts, run_to_end

VOCAB = 50


@dataclass
class Row:
    request_id: str
    params: SamplingParams
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def reference_adjust(
    logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], params: SamplingParams, eos: Sequence[int] = ()
) -> torch.Tensor:
    """One row's logits as vLLM's processors leave them, one token at a time: allowed tokens, bad
    words, min_tokens, bias, then repetition (Hugging Face's), frequency and presence penalties."""
    x = logits.clone()
    if params.allowed_token_ids:
        for token in range(len(x)):
            if token not in params.allowed_token_ids:
                x[token] = -math.inf
    for word in params.bad_words_token_ids:
        *head, last = word
        if not head or list(output[-len(head) :]) == head:
            x[last] = -math.inf
    if len(output) < params.min_tokens:
        for token in (*params.stop_token_ids, *eos):  # EOS too, even with ignore_eos
            x[token] = -math.inf
    for token, bias in params.logit_bias:
        x[token] += bias
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            value = x[token]
            x[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count
        x[token] -= params.presence_penalty
    return x


def _history(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


MIXES = [
    SamplingParams(presence_penalty=0.5),
    SamplingParams(frequency_penalty=-0.75),
    SamplingParams(repetition_penalty=1.25),
    SamplingParams(repetition_penalty=0.5, frequency_penalty=1.5, presence_penalty=-2.0),
    SamplingParams(logit_bias=((3, -100.0), (7, 12.5))),
    SamplingParams(max_tokens=20, min_tokens=9, stop_token_ids=(4, 5)),
    SamplingParams(max_tokens=20, min_tokens=9, stop_token_ids=(4,), ignore_eos=True),
    SamplingParams(allowed_token_ids=(1, 2, 3, 9, 40)),
    SamplingParams(allowed_token_ids=(2, 7), logit_bias=((7, 3.0),), min_tokens=3, stop_token_ids=(2,)),
    SamplingParams(bad_words_token_ids=((5,), (8, 9), (1, 2, 3))),
    SamplingParams(),
]


def test_batched_adjustments_equal_the_reference_row_by_row() -> None:
    rng = random.Random(0)
    rows = [Row(f"r{i}", p, _history(rng, 6), _history(rng, 8)) for i, p in enumerate(MIXES)]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    expected = torch.stack(
        [reference_adjust(logits[i], r.prompt_ids, r.output_ids, r.params, eos=(2,)) for i, r in enumerate(rows)]
    )
    LogitsProcessing(frozenset({2})).apply(logits, rows)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_bad_words_mask_only_the_token_that_would_complete_one() -> None:
    params = SamplingParams(bad_words_token_ids=((5,), (8, 9), (1, 2, 3), (4, 4)))
    for output, banned in [
        ([], {5}),
        ([8], {5, 9}),
        ([1, 2], {5, 3}),
        ([2, 1], {5}),
        ([7, 4], {5, 4}),
        ([1, 2, 8], {5, 9}),
    ]:
        logits = torch.zeros(1, VOCAB)
        LogitsProcessing().apply(logits, [Row("r", params, [1, 2], output)])
        assert set(torch.nonzero(logits[0] == -math.inf).flatten().tolist()) == banned, output


DIGITS = StructuredOutput(StructuredKind.REGEX, "[0-9]")


def test_rows_their_own_bans_leave_empty_are_found_and_no_others() -> None:
    processing = LogitsProcessing(frozenset({2}))
    rows = [
        Row("only-eos", SamplingParams(max_tokens=8, min_tokens=3, allowed_token_ids=(2,))),
        Row("eos-later", SamplingParams(max_tokens=8, min_tokens=3, allowed_token_ids=(2,)), [], [1, 1, 1]),
        Row("plain", SamplingParams()),
        Row("bad-word", SamplingParams(bad_words_token_ids=((6,),), structured_output=DIGITS)),
    ]
    logits = torch.randn(len(rows), VOCAB)
    logits[3] = -math.inf  # as a grammar allowing token 6 alone would leave it
    logits[3, 6] = 0.0
    logits[2] = -math.inf  # no bans of its own: not this check's to judge
    assert processing.apply(logits, rows).dead == [0, 3]
    processing.release("only-eos")
    assert "only-eos" not in processing._requests and "eos-later" in processing._requests


def test_counts_kept_step_by_step_equal_counts_rebuilt_from_the_tokens() -> None:
    """A request re-admitted with its output gets the counts it had: its row is rebuilt from it."""
    params = SamplingParams(repetition_penalty=1.25, frequency_penalty=0.75, presence_penalty=0.5)
    running = LogitsProcessing()
    row = Row("a", params, [1, 2, 3])
    gen = torch.Generator().manual_seed(2)
    for _ in range(12):
        logits = torch.randn(1, VOCAB, generator=gen)
        rebuilt = logits.clone()
        penalised = running.apply(logits, [row]).penalised
        assert penalised is not None
        fresh = LogitsProcessing()
        fresh.apply(rebuilt, [Row("a", params, list(row.prompt_ids), list(row.output_ids))])
        assert torch.equal(logits, rebuilt)
        token = torch.tensor([int(torch.randint(VOCAB, (1,), generator=gen))])
        penalised.record(token)
        row.output_ids.append(int(token))


def test_released_rows_are_reused_and_rebuilt() -> None:
    processing = LogitsProcessing()
    params = SamplingParams(frequency_penalty=1.0)
    processing.apply(torch.zeros(2, VOCAB), [Row("a", params, [], [1]), Row("b", params, [], [2])])
    assert processing.table is not None and len(processing.table) == 2
    processing.release("a")
    processing.release("never-seen")
    assert len(processing.table) == 1
    logits = torch.zeros(1, VOCAB)
    processing.apply(logits, [Row("c", params, [], [3, 3])])
    assert logits[0, 3] == -2.0 and logits[0, 1] == 0.0  # "a"'s old counts are gone


# ---- the engine, against the model -------------------------------------------------------------


@torch.inference_mode()
def reference_loop(
    model: GenerationMixin, prompt: list[int], max_tokens: int, params: SamplingParams, eos: Sequence[int] = ()
) -> Reference:
    """Greedy decoding by hand over ``model(...)``'s logits, adjusted by ``reference_adjust``."""
    output: list[int] = []
    gaps: list[float] = []
    for _ in range(max_tokens):
        logits = model(torch.tensor([prompt + output])).logits[0, -1].float()  # type: ignore[operator]
        adjusted = reference_adjust(logits, prompt, output, params, eos)
        top2 = torch.topk(adjusted, 2).values
        gaps.append(float(top2[0] - top2[1]))
        output.append(int(adjusted.argmax()))
    return Reference(output, gaps)


@torch.inference_mode()
def hf_greedy(model: GenerationMixin, prompt: list[int], max_tokens: int, **processors: float) -> Reference:
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        output_scores=True,  # the processed scores: their top-2 gaps tell a near-tie
        return_dict_in_generate=True,
        **processors,
    )
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), generation_config=config
    )
    gaps = [float((lambda t: t[0] - t[1])(torch.topk(s[0].float(), 2).values)) for s in out.scores]
    return Reference(out.sequences[0, len(prompt) :].tolist(), gaps)


def spec(request_id: str, prompt: list[int], params: SamplingParams, output: Sequence[int] = ()) -> AdmitSpec:
    return AdmitSpec(request_id, tuple(prompt), tuple(output), params, 0.0)


def staggered(specs: list[AdmitSpec]) -> dict[int, list[AdmitSpec]]:
    """Two requests join every third step, so each one shares its steps with others."""
    arrivals: dict[int, list[AdmitSpec]] = {}
    for i, s in enumerate(specs):
        arrivals.setdefault((i // 2) * 3, []).append(s)
    return arrivals


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> GenerationMixin:
    return load_reference_model(tiny_model_dir)


def test_repetition_penalty_matches_hf_generate_in_a_mixed_batch(engine: Engine, model: GenerationMixin) -> None:
    batch = prompts(6, seed=21)
    penalties = [1.3, None, 0.7, None, 2.0, 1.1]
    specs = [
        spec(f"p{i}", p, SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=r or 1.0))
        for i, (p, r) in enumerate(zip(batch, penalties, strict=True))
    ]
    outputs = run_to_end(engine, staggered(specs))
    for s, r in zip(specs, penalties, strict=True):
        kwargs = {"repetition_penalty": r} if r else {}
        ref = hf_greedy(model, list(s.prompt_ids), 24, **kwargs)
        assert_matches_reference(outputs[s.request_id], ref, s.request_id)
    assert outputs["p0"] != hf_greedy(model, batch[0], 24).tokens  # the penalty changed something
    assert engine.allocator.num_used == 0 and engine.sampler.processing.table is not None
    assert len(engine.sampler.processing.table) == 0  # every finished request gave its row back


OPENAI_MIXES = [
    SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(max_tokens=20, ignore_eos=True, frequency_penalty=0.8),
    SamplingParams(max_tokens=20, ignore_eos=True, frequency_penalty=-0.5, presence_penalty=2.0),
    SamplingParams(max_tokens=20, ignore_eos=True),
    SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=0.7, repetition_penalty=1.2),
]


def test_presence_and_frequency_penalties_match_a_reference_loop(engine: Engine, model: GenerationMixin) -> None:
    batch = prompts(len(OPENAI_MIXES), seed=22)
    specs = [spec(f"o{i}", p, params) for i, (p, params) in enumerate(zip(batch, OPENAI_MIXES, strict=True))]
    outputs = run_to_end(engine, staggered(specs))
    for s in specs:
        ref = reference_loop(model, list(s.prompt_ids), 20, s.params)
        assert_matches_reference(outputs[s.request_id], ref, s.request_id)
    plain = reference_loop(model, batch[0], 20, SamplingParams(max_tokens=20))
    assert outputs["o0"] != plain.tokens  # the penalty changed something


def test_penalised_request_resumes_exactly(engine: Engine) -> None:
    """After a preemption or a migration the scheduler re-admits a request with its output so
    far: the penalties count those tokens, as if it had never stopped."""
    prompt = prompts(1, seed=23)[0]
    params = SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=1.0, repetition_penalty=1.3)
    whole = run_to_end(engine, {0: [spec("w", prompt, params)]})["w"]
    resumed = run_to_end(engine, {0: [spec("w2", prompt, params, whole[:9])]})["w2"]
    assert whole[:9] + resumed == whole
    # Re-admitted over itself mid-run (the scheduler's word wins): its row is rebuilt, not reused.
    engine.apply(PlanUpdate(seq=1, admit=(spec("x", prompt, params),)))
    for _ in range(6):
        engine.step()
    rest = run_to_end(engine, {0: [spec("x", prompt, params, whole[:3])]})["x"]
    assert rest[-21:] == whole[3:]


def test_min_tokens_holds_off_stop_tokens(engine: Engine, model: GenerationMixin) -> None:
    prompt = prompts(1, seed=24)[0]
    free = run_to_end(engine, {0: [spec("f", prompt, SamplingParams(max_tokens=12, ignore_eos=True))]})["f"]
    stop = free[1]  # the free run would stop at its second token
    params = SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=5, stop_token_ids=(stop,))
    engine.apply(PlanUpdate(seq=1, admit=(spec("m", prompt, params),)))
    tokens: list[int] = []
    reasons = []
    while engine.has_work:
        out = engine.step()
        tokens += [t for d in out.tokens for t in d.token_ids]
        reasons += [f.reason for f in out.finished]
    assert stop not in tokens[:5]
    ref = reference_loop(model, prompt, 12, params)
    if stop in ref.tokens:  # it stops at the first one it may produce
        ref = Reference(ref.tokens[: ref.tokens.index(stop) + 1], ref.gaps)
    assert_matches_reference(tokens, ref, "min_tokens")
    assert reasons == [FinishReason.STOP if tokens[-1] == stop else FinishReason.LENGTH]


def test_logit_bias_forces_and_bans_tokens(engine: Engine) -> None:
    prompt = prompts(1, seed=25)[0]
    forced = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((77, 100.0),))
    free = run_to_end(engine, {0: [spec("free", prompt, SamplingParams(max_tokens=6, ignore_eos=True))]})["free"]
    banned = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=tuple((t, -100.0) for t in set(free)))
    outputs = run_to_end(engine, {0: [spec("forced", prompt, forced), spec("banned", prompt, banned)]})
    assert outputs["forced"] == [77] * 6
    assert not set(outputs["banned"]) & set(free)


def test_allowed_tokens_and_bad_words_match_a_reference_loop(engine: Engine, model: GenerationMixin) -> None:
    batch = prompts(4, seed=26)
    free = run_to_end(engine, {0: [spec("free", batch[0], SamplingParams(max_tokens=16, ignore_eos=True))]})["free"]
    mixes = [
        SamplingParams(max_tokens=16, ignore_eos=True, allowed_token_ids=tuple(range(100, 400, 3))),
        # A word the free run spells, and one of its single tokens: both must go.
        SamplingParams(max_tokens=16, ignore_eos=True, bad_words_token_ids=(tuple(free[2:5]), (free[0],))),
        SamplingParams(max_tokens=16, ignore_eos=True, allowed_token_ids=tuple(free), frequency_penalty=0.5),
        SamplingParams(max_tokens=16, ignore_eos=True),
    ]
    specs = [spec(f"v{i}", batch[0 if i < 2 else i], p) for i, p in enumerate(mixes)]
    outputs = run_to_end(engine, staggered(specs))
    for s in specs:
        ref = reference_loop(model, list(s.prompt_ids), 16, s.params)
        assert_matches_reference(outputs[s.request_id], ref, s.request_id)
    assert set(outputs["v0"]) <= set(range(100, 400, 3))
    assert free[0] not in outputs["v1"] and outputs["v1"] != free
    assert not engine.sampler.processing._requests  # every finished request's tensors are gone


def test_a_request_its_bans_leave_nothing_ends_alone_with_an_error(engine: Engine) -> None:
    prompt = prompts(1, seed=27)[0]
    free = run_to_end(engine, {0: [spec("free", prompt, SamplingParams(max_tokens=8, ignore_eos=True))]})["free"]
    stop = free[0]
    stuck = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(stop,), allowed_token_ids=(stop,))
    engine.apply(
        PlanUpdate(
            seq=1,
            admit=(spec("stuck", prompt, stuck), spec("free2", prompt, SamplingParams(max_tokens=8, ignore_eos=True))),
        )
    )
    tokens: dict[str, list[int]] = {}
    finished = {}
    while engine.has_work:
        out = engine.step()
        for delta in out.tokens:
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        finished.update({f.request_id: f for f in out.finished})
    assert finished["stuck"].reason is FinishReason.ERROR and "no token may be sampled" in finished["stuck"].error
    assert tokens.get("stuck", []) == []
    assert tokens["free2"] == free and finished["free2"].reason is FinishReason.LENGTH
    assert engine.allocator.num_used == 0


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_text_is_kept_only_when_asked(engine: Engine, skip: bool) -> None:
    prompt = prompts(1, seed=28)[0]
    eos = min(engine.limits.eos_token_ids)
    params = SamplingParams(max_tokens=3, ignore_eos=True, allowed_token_ids=(eos,), skip_special_tokens=skip)
    engine.apply(PlanUpdate(seq=1, admit=(spec("s", prompt, params),)))
    text = ""
    while engine.has_work:
        out = engine.step()
        text += "".join(d.text for d in out.tokens) + "".join(f.text for f in out.finished)
    special = engine.tokenizer.convert_ids_to_tokens(eos)  # type: ignore[attr-defined]
    assert text == ("" if skip else special * 3)
