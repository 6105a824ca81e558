"""Models whose attention Baton would compute wrongly are refused; a sliding-window model is served
exactly with its context capped to the window."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

from executor_service.model_support import UnsupportedModel, check_model_support
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.executor_service.test_engine import admit, make_engine, run_to_end

WINDOW = 32


def test_full_attention_is_served_as_it_is() -> None:
    support = check_model_support(LlamaConfig(max_position_embeddings=2048), 2048)
    assert (support.max_model_len, support.sliding_window) == (2048, None)


def test_a_sliding_window_caps_the_context_to_the_window() -> None:
    support = check_model_support(MistralConfig(sliding_window=WINDOW), 2048)
    assert (support.max_model_len, support.sliding_window) == (WINDOW, WINDOW)
    wide = check_model_support(MistralConfig(sliding_window=4096), 2048)  # never bites
    assert wide.max_model_len == 2048


def test_a_window_the_model_does_not_use_changes_nothing() -> None:
    config = Qwen2Config(use_sliding_window=False, sliding_window=WINDOW)
    assert check_model_support(config, 2048).max_model_len == 2048


@pytest.mark.parametrize(
    "config",
    [Gemma2Config(), SimpleNamespace(model_type="sinky", attention_sinks=True)],
    ids=["attention-softcapping", "attention-sinks"],
)
def test_attention_the_executor_does_not_compute_is_refused(config: object) -> None:
    with pytest.raises(UnsupportedModel, match="Baton"):
        check_model_support(config, 2048)


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


def test_a_sliding_window_model_is_exact_inside_its_window(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = MistralConfig(
        vocab_size=_vocab(tiny_model_dir), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, max_position_embeddings=256,
    )  # fmt: skip
    model_dir = _save(config, tiny_model_dir, tmp_path / "mistral")
    engine = make_engine(model_dir)
    assert engine.limits.max_model_len == WINDOW
    prompts = {"a": [1, 50, 60, 70, 80, 90], "b": [1, *range(100, 118)], "c": [1, 7, 7, 7]}
    lengths = {"a": 20, "b": 12, "c": 27}  # each ends one token short of the window
    got = run_to_end(engine, {0: [admit("a", prompts["a"], 20)], 2: [admit("b", prompts["b"], 12)],
                              3: [admit("c", prompts["c"], 27)]})  # fmt: skip
    reference = load_reference_model(model_dir)
    for rid, prompt in prompts.items():
        assert_matches_reference(got[rid], reference_greedy(reference, prompt, lengths[rid]), rid)


def test_a_model_with_attention_softcapping_is_refused_at_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = Gemma2Config(
        vocab_size=_vocab(tiny_model_dir), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model_dir = _save(config, tiny_model_dir, tmp_path / "gemma2")
    with pytest.raises(UnsupportedModel, match="soft-caps its attention logits"):
        make_engine(model_dir)
