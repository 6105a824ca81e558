"""The one sampling-parameter type: its value checks and its two encodings (Redis JSON, the executor wire)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from common.pb import executor_pb2 as pb
from common.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": math.nan},
        {"top_k": -1},
        {"max_tokens": 0},
        {"stop": ("",)},
        {"seed": 1 << 64},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"frequency_penalty": math.nan},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": math.inf},
        {"min_tokens": -1},
        {"min_tokens": 17},  # more than max_tokens (16)
        {"min_p": 1.5},
        {"min_p": -0.1},
        {"logit_bias": ((1, 100.5),)},
        {"logit_bias": ((1, math.nan),)},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": ((3, 1.0), (3, 2.0))},
        {"logprobs": 21},
        {"logprobs": -1},
        {"prompt_logprobs": 21},
        {"max_tokens": 0, "logprobs": 2},  # 0 only scores a prompt
        {"allowed_token_ids": (-1,)},
        {"bad_words_token_ids": ((),)},
        {"bad_words_token_ids": ((3, -2),)},
    ],
)
def test_invalid_params_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_params_are_hashable_from_lists() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])  # type: ignore[arg-type]
    assert params.stop == ("a", "b") and params.stop_token_ids == (1, 2)
    hash(params)


FULL = SamplingParams(
    max_tokens=7,
    temperature=0.75,
    top_p=0.5,
    top_k=3,
    seed=(1 << 64) - 1,
    stop=("a", "b"),
    stop_token_ids=(4, 5),
    ignore_eos=True,
    stream_interval_tokens=8,
    presence_penalty=-1.25,
    frequency_penalty=0.5,
    repetition_penalty=1.5,
    min_tokens=2,
    min_p=0.25,
    logit_bias=((9, 2.5), (3, -100.0)),
    include_stop_str_in_output=True,
    logprobs=0,
    prompt_logprobs=20,
    skip_special_tokens=False,
    allowed_token_ids=(3, 9, 4, 5),
    bad_words_token_ids=((7,), (8, 1, 2)),
)


@pytest.mark.parametrize("params", [SamplingParams(), FULL], ids=["defaults", "every-field"])
def test_json_round_trip(params: SamplingParams) -> None:
    assert SamplingParams.from_json(params.to_json()) == params


@pytest.mark.parametrize("params", [SamplingParams(), FULL], ids=["defaults", "every-field"])
def test_executor_wire_round_trip_carries_what_sampling_needs(params: SamplingParams) -> None:
    back = SamplingParams.from_pb(pb.ExecSampling.FromString(params.to_pb().SerializeToString()))
    # The stream interval is the scheduler's business and stays behind.
    assert back == replace(params, stream_interval_tokens=0)


def test_an_unset_seed_stays_unset_on_the_wire() -> None:
    assert not SamplingParams().to_pb().HasField("seed")
    assert SamplingParams.from_pb(pb.ExecSampling(max_tokens=1, top_p=1.0)).seed is None


def test_logit_bias_is_kept_by_token_id_from_any_pairs() -> None:
    params = SamplingParams(logit_bias=[[9, 1], [2, -3.5]])  # type: ignore[arg-type]
    assert params.logit_bias == ((2, -3.5), (9, 1.0))
    hash(params)


def test_token_bans_are_kept_hashable_and_adjust_logits() -> None:
    params = SamplingParams(allowed_token_ids=[5, 2, 5], bad_words_token_ids=[[1, 2], [3]])  # type: ignore[arg-type]
    assert params.allowed_token_ids == (2, 5) and params.bad_words_token_ids == ((1, 2), (3,))
    assert params.bans_tokens and params.adjusts_logits
    hash(params)


def test_max_tokens_zero_scores_a_prompt() -> None:
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    assert SamplingParams.from_pb(params.to_pb()) == params


def test_unset_new_fields_read_as_off() -> None:
    """Records and plans written before these fields existed, and proto3's zero values."""
    old_record = '{"max_tokens":3,"temperature":0.0,"top_p":1.0,"top_k":0,"seed":null,"stop":[],"stop_token_ids":[]}'
    params = SamplingParams.from_json(old_record)
    assert not params.adjusts_logits and params.logprobs is None and params.prompt_logprobs is None
    assert params.skip_special_tokens and not params.bans_tokens
    wire = SamplingParams.from_pb(pb.ExecSampling(max_tokens=1, top_p=1.0))
    assert wire.repetition_penalty == 1.0 and not wire.adjusts_logits and wire.logprobs is None
    assert wire.skip_special_tokens
    assert not SamplingParams().to_pb().HasField("logprobs")
