"""A model's recommended sampling settings, as read from its generation_config and carried in Redis."""

from __future__ import annotations

from transformers import GenerationConfig

from common.pb import generate_pb2 as pb
from common.sampling_defaults import SamplingDefaults


def test_what_the_generation_config_sets_is_recommended() -> None:
    config = GenerationConfig(temperature=0.6, top_p=0.9, do_sample=True, max_new_tokens=512, min_p=0.05)
    defaults = SamplingDefaults.of_generation_config(config)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9, min_p=0.05, max_tokens=512)
    # A config that sets none of them (the generated models' own) recommends nothing.
    assert (
        SamplingDefaults.of_generation_config(GenerationConfig(do_sample=False, eos_token_id=2)) == SamplingDefaults()
    )
    assert SamplingDefaults.of_generation_config(None) == SamplingDefaults()


def test_the_json_in_redis_round_trips_and_malformed_counts_as_none() -> None:
    defaults = SamplingDefaults(temperature=0.0, top_k=7, repetition_penalty=1.05)
    assert SamplingDefaults.from_json(defaults.to_json()) == defaults
    assert defaults.to_pb() == pb.SamplingDefaults(temperature=0.0, top_k=7, repetition_penalty=1.05)
    for text in ("", "[1", "[1, 2]", '"x"', '{"top_k": -1, "temperature": "hot", "top_p": true}', "[" * 5000):
        assert SamplingDefaults.from_json(text) == SamplingDefaults()
