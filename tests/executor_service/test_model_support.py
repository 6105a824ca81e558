"""What a model asks of the attention, read from its config; a sliding-window model is served at its
whole length, and one no backend computes is refused at load (the registry's verdicts per backend:
backends/test_registry.py; windowed models beyond their window: test_sliding_window.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

from executor_service.model_support import ModelTraits, UnsupportedModel
from executor_service.server import warm_up
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.executor_service.test_engine import admit, make_engine, run_to_end

WINDOW = 32


def test_full_attention_is_served_as_it_is() -> None:
    traits = ModelTraits.from_config(LlamaConfig(max_position_embeddings=2048))
    assert (traits.model_type, traits.hidden_act, traits.sliding_window) == ("llama", "silu", None)
    assert traits.attn_logit_softcapping is None and not traits.attention_sinks
    assert not traits.every_layer_windowed


def test_a_sliding_window_and_the_layers_it_covers_are_read_from_the_config() -> None:
    mistral = ModelTraits.from_config(MistralConfig(sliding_window=WINDOW))
    assert (mistral.sliding_window, mistral.every_layer_windowed) == (WINDOW, True)  # Mistral windows every layer
    gemma2 = ModelTraits.from_config(Gemma2Config(sliding_window=WINDOW))  # alternating with global layers
    assert (gemma2.sliding_window, gemma2.every_layer_windowed) == (WINDOW, False)
    for full_layers, every_layer in ((0, True), (2, False)):  # Qwen2 windows the layers from max_window_layers on
        qwen2 = Qwen2Config(
            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=full_layers, num_hidden_layers=4
        )
        traits = ModelTraits.from_config(qwen2)
        assert (traits.sliding_window, traits.every_layer_windowed) == (WINDOW, every_layer)


def test_a_window_the_model_does_not_use_changes_nothing() -> None:
    traits = ModelTraits.from_config(Qwen2Config(use_sliding_window=False, sliding_window=WINDOW))
    assert traits.sliding_window is None and not traits.every_layer_windowed
    beyond_its_layers = Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, num_hidden_layers=4)
    assert ModelTraits.from_config(beyond_its_layers).sliding_window is None  # max_window_layers 28 of 4


def test_softcapping_and_sinks_are_read_from_the_config() -> None:
    assert ModelTraits.from_config(Gemma2Config()).attn_logit_softcapping == 50.0
    assert ModelTraits.from_config(SimpleNamespace(model_type="sinky", attention_sinks=True)).attention_sinks
    # gpt-oss keeps its sinks as a module parameter, not in its config: read from what its modules pass.
    assert ModelTraits.from_config(AutoConfig.for_model("gpt_oss")).attention_sinks
    assert not ModelTraits.from_config(LlamaConfig()).attention_sinks


def _save(config: PretrainedConfig, tiny_model_dir: Path, out: Path) -> Path:
    """A random-weight model of ``config`` beside the generated model's tokenizer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


def _vocab(tiny_model_dir: Path) -> int:
    return int(LlamaConfig.from_pretrained(tiny_model_dir).vocab_size)


def test_a_sliding_window_model_is_served_at_its_whole_length(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = MistralConfig(
        vocab_size=_vocab(tiny_model_dir), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, max_position_embeddings=256,
    )  # fmt: skip
    model_dir = _save(config, tiny_model_dir, tmp_path / "mistral")
    engine = make_engine(model_dir)
    assert engine.limits.max_model_len == 256, "the window does not cap the context"
    assert engine.runner.backend.name == "cpu_native", "the lean Llama forward passes Mistral's window"
    prompts = {"a": [1, 50, 60, 70, 80, 90], "b": [1, *range(100, 118)], "c": [1, 7, 7, 7]}
    lengths = {"a": 40, "b": 30, "c": 60}  # each runs past the window
    got = run_to_end(engine, {0: [admit("a", prompts["a"], 40)], 2: [admit("b", prompts["b"], 30)],
                              3: [admit("c", prompts["c"], 60)]})  # fmt: skip
    reference = load_reference_model(model_dir)
    for rid, prompt in prompts.items():
        assert_matches_reference(got[rid], reference_greedy(reference, prompt, lengths[rid]), rid)


def test_a_model_with_attention_softcapping_loads_on_the_reference_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = Gemma2Config(
        vocab_size=_vocab(tiny_model_dir), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model_dir = _save(config, tiny_model_dir, tmp_path / "gemma2")
    assert make_engine(model_dir).runner.backend.name == "torch"
    with pytest.raises(UnsupportedModel, match="soft-caps its attention logits"):
        make_engine(model_dir, backend="cpu_transformers")


# Configs that ran and answered wrongly before they were refused: each with what refuses it.
_UNSERVABLE: dict[str, tuple[dict[str, Any], str]] = {
    "bloom": ({}, "attention interface"),  # its own attention code
    "xglm": ({}, "attention interface"),
    "mamba": ({}, "linear_attention layers"),  # a state-space state, no KV at all
    "jamba": ({}, "linear_attention layers"),
    "llama4_text": ({"attention_chunk_size": 16}, "attends in chunks of 16"),
    "diffllama": ({}, "twice per layer"),
    "doge": ({}, "dynamic mask"),
    "qwen2_moe": (
        {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1, "num_hidden_layers": 2},
        "only through the mask",
    ),
    "phi3": (
        {
            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48},
            "original_max_position_embeddings": 64,
        },
        "longrope",
    ),
}


@pytest.mark.parametrize("model_type", _UNSERVABLE)
def test_models_no_backend_computes_exactly_are_named_unservable(model_type: str) -> None:
    overrides, reason = _UNSERVABLE[model_type]
    traits = ModelTraits.from_config(AutoConfig.for_model(model_type, **overrides))
    assert any(reason in found for found in traits.unservable), traits.unservable


@pytest.mark.parametrize(
    "config",
    [LlamaConfig(), MistralConfig(sliding_window=WINDOW), Gemma2Config(), Qwen2Config(), AutoConfig.for_model("gpt2")],
    ids=["llama", "mistral-window", "gemma2", "qwen2", "gpt2"],
)
def test_models_served_exactly_are_not(config: PretrainedConfig) -> None:
    assert ModelTraits.from_config(config).unservable == ()


def test_an_unservable_model_is_refused_at_load_with_its_reason(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A state-space model has no attention at all: it used to load and answer wrongly."""
    config = AutoConfig.for_model(
        "mamba", vocab_size=_vocab(tiny_model_dir), hidden_size=64, state_size=8, num_hidden_layers=2
    )
    model_dir = _save(config, tiny_model_dir, tmp_path / "mamba")
    with pytest.raises(UnsupportedModel, match="which no backend computes"):
        make_engine(model_dir)


def test_a_model_whose_first_step_fails_is_refused_before_it_serves(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Nemotron's config passes every check, but its layers drop the attention's keyword arguments:
    the warm-up step at start refuses it with that reason instead of a bare KeyError."""
    config = AutoConfig.for_model(
        "nemotron", vocab_size=_vocab(tiny_model_dir), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    )  # fmt: skip
    engine = make_engine(_save(config, tiny_model_dir, tmp_path / "nemotron"))
    with pytest.raises(UnsupportedModel, match=r"first step failed.*do not pass the step's attention arguments"):
        warm_up(engine, "nemotron")
