"""The one sampling-parameter type: its value checks and its two encodings (Redis JSON, the executor wire)."""

from __future__ import annotations

import math

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
)


@pytest.mark.parametrize("params", [SamplingParams(), FULL], ids=["defaults", "every-field"])
def test_json_round_trip(params: SamplingParams) -> None:
    assert SamplingParams.from_json(params.to_json()) == params


@pytest.mark.parametrize("params", [SamplingParams(), FULL], ids=["defaults", "every-field"])
def test_executor_wire_round_trip_carries_what_sampling_needs(params: SamplingParams) -> None:
    back = SamplingParams.from_pb(pb.ExecSampling.FromString(params.to_pb().SerializeToString()))
    # The stream interval is the scheduler's business and stays behind.
    assert back == SamplingParams(**{**params.__dict__, "stream_interval_tokens": 0})


def test_an_unset_seed_stays_unset_on_the_wire() -> None:
    assert not SamplingParams().to_pb().HasField("seed")
    assert SamplingParams.from_pb(pb.ExecSampling(max_tokens=1, top_p=1.0)).seed is None
