from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from common.sampling_params import SamplingParams
from executor_service.sampling import Sampler, make_generator

VOCAB = 64


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, VOCAB, generator=gen) * 3.0


def test_greedy_is_argmax() -> None:
    logits = _logits(5)
    params = [SamplingParams()] * 5
    out = Sampler().choose(logits, params, [None] * 5)
    assert out.dtype == torch.int64
    assert out.shape == (5,)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    logits = _logits(4)
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.7)]
    gens = [None, make_generator(1, "cpu"), None, make_generator(2, "cpu")]
    out = Sampler().choose(logits, params, gens)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert all(0 <= int(t) < VOCAB for t in out)


def _run(seed: int, steps: int, batch_with: int) -> list[int]:
    """Sample ``steps`` tokens for a seeded request placed among ``batch_with`` other requests."""
    sampler = Sampler()
    mine = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=seed)
    gen = make_generator(seed, "cpu")
    # Neighbours alternate greedy / seeded-sampled / unseeded-sampled, so every code path is in the batch.
    others: list[tuple[SamplingParams, torch.Generator | None]] = []
    for i in range(batch_with):
        if i % 3 == 0:
            others.append((SamplingParams(), None))
        elif i % 3 == 1:
            others.append((SamplingParams(temperature=1.3, seed=100 + i), make_generator(100 + i, "cpu")))
        else:
            others.append((SamplingParams(temperature=0.5, top_p=0.5), None))
    position = batch_with // 2
    tokens = []
    for step in range(steps):
        # My row depends only on the step; the neighbours' rows change with the batch size.
        logits = _logits(batch_with + 1, seed=1000 + step * 7 + batch_with)
        logits[position] = _logits(1, seed=step)[0]
        params = [p for p, _ in others]
        gens = [g for _, g in others]
        params.insert(position, mine)
        gens.insert(position, gen)
        tokens.append(int(sampler.choose(logits, params, gens)[position]))
    return tokens


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    alone = _run(seed=42, steps=30, batch_with=0)
    assert alone == _run(seed=42, steps=30, batch_with=3)
    assert alone == _run(seed=42, steps=30, batch_with=8)
    assert alone != _run(seed=43, steps=30, batch_with=0)  # 30 draws from ~20 tokens: a collision is negligible


def test_unfiltered_row_is_unaffected_by_a_filtered_neighbour() -> None:
    # The filtered neighbour forces the sort/mask path; the plain row must draw from the very same distribution.
    plain = SamplingParams(temperature=1.0, seed=7)
    logits = _logits(2)
    gen_a, gen_b = make_generator(7, "cpu"), make_generator(7, "cpu")
    seq_alone = [int(Sampler().choose(logits[:1], [plain], [gen_a])[0]) for _ in range(40)]
    neighbour = SamplingParams(temperature=1.0, top_k=3)
    seq_mixed = [int(Sampler().choose(logits, [plain, neighbour], [gen_b, None])[0]) for _ in range(40)]
    assert seq_alone == seq_mixed


def test_top_k_one_is_greedy() -> None:
    logits = _logits(6, seed=3)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(6)]
    gens = [make_generator(i, "cpu") for i in range(6)]
    for _ in range(10):
        assert torch.equal(Sampler().choose(logits, params, gens), logits.argmax(dim=-1))


def test_tiny_top_p_is_greedy() -> None:
    logits = _logits(6, seed=4)
    params = [SamplingParams(temperature=2.0, top_p=1e-6) for _ in range(6)]
    for _ in range(10):
        out = Sampler().choose(logits, params, [make_generator(None, "cpu") for _ in range(6)])
        assert torch.equal(out, logits.argmax(dim=-1))


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # Probabilities 0.5, 0.3, 0.2: p=0.6 needs the first two, p=0.45 only the first.
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    gen = make_generator(0, "cpu")

    def seen(top_p: float, draws: int) -> set[int]:
        params = [SamplingParams(temperature=1.0, top_p=top_p)]
        return {int(Sampler().choose(logits, params, [gen])[0]) for _ in range(draws)}

    seen_06, seen_045 = seen(0.6, 200), seen(0.45, 50)
    assert seen_06 == {1, 2}
    assert seen_045 == {1}


def test_sampled_tokens_stay_in_top_k() -> None:
    logits = _logits(3, seed=5)
    k = 5
    allowed = [set(logits[i].topk(k).indices.tolist()) for i in range(3)]
    params = [SamplingParams(temperature=5.0, top_k=k, seed=i) for i in range(3)]
    gens = [make_generator(i, "cpu") for i in range(3)]
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(300):
        out = Sampler().choose(logits, params, gens)
        for i in range(3):
            seen[i].add(int(out[i]))
    for i in range(3):
        assert seen[i] <= allowed[i]
        assert len(seen[i]) > 1  # a hot temperature really samples


def test_unseeded_generators_are_independent() -> None:
    a, b = make_generator(None, "cpu"), make_generator(None, "cpu")
    assert a.initial_seed() != b.initial_seed()
    assert make_generator(5, "cpu").initial_seed() == 5


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(_logits(2), [Row("a", SamplingParams())], [None])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(VOCAB), [Row("a", SamplingParams())], [None])


@dataclass
class Row:
    """What the sampler reads of a sequence."""

    request_id: str
    params: SamplingParams
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def test_rows_that_ask_for_nothing_keep_their_logits_and_argmax() -> None:
    logits = _logits(3, seed=8)
    before = logits.clone()
    rows = [
        Row("plain", SamplingParams()),
        Row("biased", SamplingParams(logit_bias=((5, 100.0),))),
        Row("penalised", SamplingParams(frequency_penalty=2.0), output_ids=[int(before[2].argmax())] * 3),
    ]
    out = Sampler().sample(logits, rows, [None] * 3)
    assert out.tokens[0] == int(before[0].argmax()) and torch.equal(logits[0], before[0])
    assert out.tokens[1] == 5
    assert out.tokens[2] != int(before[2].argmax())
    assert out.logprobs == [None, None, None]


def test_min_p_keeps_tokens_near_the_top() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps those >= 0.25.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = [SamplingParams(temperature=1.0, min_p=0.5)]
    gen = make_generator(3, "cpu")
    seen = {int(Sampler().choose(logits.clone(), params, [gen])[0]) for _ in range(300)}
    assert seen == {0, 1}
    unfiltered = [SamplingParams(temperature=1.0)]
    assert len({int(Sampler().choose(logits.clone(), unfiltered, [gen])[0]) for _ in range(300)}) == 4


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_raw_distribution(temperature: float) -> None:
    """vLLM's raw_logprobs: log_softmax of the model's logits, whatever the penalties, bias and temperature."""
    logits = _logits(2, seed=9)
    expected = torch.log_softmax(logits, dim=-1)
    params = SamplingParams(
        temperature=temperature, seed=1, logprobs=5, logit_bias=((1, 3.0),), presence_penalty=1.0, top_k=10
    )
    rows = [Row("a", params, output_ids=[2, 3]), Row("b", SamplingParams(logprobs=0))]
    out = Sampler().sample(logits, rows, [make_generator(1, "cpu"), None])
    a, b = out.logprobs
    assert a is not None and b is not None
    assert a.token_ids == (out.tokens[0],) and b.token_ids == (out.tokens[1],)
    assert a.logprobs[0] == pytest.approx(float(expected[0, out.tokens[0]]), abs=1e-6)
    top = torch.topk(expected[0], 5)
    assert [t for t, _ in a.top(0)] == top.indices.tolist()
    assert [x for _, x in a.top(0)] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert b.num_top == 0 and b.logprobs[0] == pytest.approx(float(expected[1].max()), abs=1e-6)


@pytest.mark.parametrize(
    "extreme",
    [SamplingParams(temperature=1e-38), SamplingParams(temperature=1.0, repetition_penalty=1e-44)],
    ids=["tiny-temperature", "tiny-repetition-penalty"],
)
def test_an_overflowing_row_takes_its_most_likely_token_and_harms_no_other(extreme: SamplingParams) -> None:
    """A tiny positive temperature or repetition penalty scaled a logit past float32's range: the
    softmax was NaN, multinomial raised, and the step failed for every request in it (the engine
    thread with it). Both are bounded where the request is read: a temperature as vLLM bounds it
    (raised to 0.01, and only 0 is greedy)."""
    assert SamplingParams(temperature=1e-6).temperature == 0.01 and not SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.5).temperature == 0.5
    logits = _logits(2)
    neighbour = SamplingParams(temperature=0.8, seed=3)
    rows = [Row("x", extreme, output_ids=[int(logits[0].argmax())]), Row("n", neighbour)]
    out = Sampler().sample(logits.clone(), rows, [make_generator(1, "cpu"), make_generator(3, "cpu")])
    alone = Sampler().sample(logits[1:].clone(), [Row("n", neighbour)], [make_generator(3, "cpu")])
    assert out.tokens[0] == int(logits[0].argmax())  # the limit: all its mass on the top token
    assert out.tokens[1] == alone.tokens[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_huge_repetition_penalty_on_the_only_allowed_token_keeps_it_finite(temperature: float) -> None:
    """Its only allowed token is in its prompt with a negative logit: multiplied by 3e38 it was -inf,
    the whole row with it (sampled: NaN, the step failed; greedy: token 0, which it did not allow)."""
    assert SamplingParams(repetition_penalty=3e38).repetition_penalty == 1e5
    logits = _logits(2, seed=12)
    allowed = int(logits[0].argmin())
    params = SamplingParams(temperature=temperature, repetition_penalty=3e38, allowed_token_ids=(allowed,), seed=1)
    neighbour = SamplingParams(temperature=0.8, seed=3)
    rows = [Row("x", params, prompt_ids=[allowed]), Row("n", neighbour)]
    out = Sampler().sample(logits.clone(), rows, [make_generator(1, "cpu"), make_generator(3, "cpu")])
    assert out.tokens[0] == allowed


def test_top_k_keeps_the_tokens_tied_with_the_kth() -> None:
    # As vLLM and transformers cut: every token at least as likely as the k-th stays.
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0]])
    gen = make_generator(0, "cpu")
    params = [SamplingParams(temperature=1.0, top_k=1)]
    assert {int(Sampler().choose(logits, params, [gen])[0]) for _ in range(100)} == {1, 2}
