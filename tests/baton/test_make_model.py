"""Tests for baton.make_model: the generated tiny Llama checkpoint loads offline and behaves deterministically."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from baton import make_model as mm

PROMPTS = ["Hello, world!", "The river ran", "Once upon a time", "1 2 3", "ünïcödé"]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def test_writes_expected_files(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    assert expected <= names


def test_model_config_and_param_count(model) -> None:
    config = model.config
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (256, 4, 4)
    assert config.num_key_value_heads == 2
    assert config.max_position_embeddings == 4096
    assert config.vocab_size == 8192
    assert config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    assert 5_000_000 <= n_params <= 9_000_000


def test_tokenizer_matches_model(model, tokenizer, tiny_model_dir: Path) -> None:
    assert tokenizer.is_fast
    assert len(tokenizer) == model.config.vocab_size == 8192
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert tokenizer.unk_token == "<unk>" and tokenizer.pad_token == "<pad>"
    assert tokenizer.bos_token_id == model.config.bos_token_id
    assert tokenizer.eos_token_id == model.config.eos_token_id
    assert tokenizer.pad_token_id == model.config.pad_token_id
    generation = GenerationConfig.from_pretrained(tiny_model_dir)
    assert generation.do_sample is False
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! ünïcödé 123",
        "  leading spaces\tand tabs\nnew lines  ",
        "日本語のテキスト 🙂🚀",
        "a",
        "x = {'a': [1, 2]}  # code",
    ],
)
def test_text_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_bos_is_prepended(tokenizer) -> None:
    ids = tokenizer("The river ran").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    plain = tokenizer("The river ran", add_special_tokens=False).input_ids
    assert plain == ids[1:]


def test_the_chat_template_frames_each_message_with_the_special_tokens(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHello</s>\n<|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    # One BOS, and the end of each turn is the model's EOS, so a greedy reply stops where a turn would.
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(tokenizer.eos_token_id) == 2
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert text == without + "<|assistant|>\n"


def test_no_chat_template_changes_nothing_else(tmp_path: Path, tiny_model_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    mm.add_arguments(parser)
    assert parser.parse_args(["--out", "x"]).chat_template is True
    assert parser.parse_args(["--out", "x", "--no-chat-template"]).chat_template is False
    assert mm.main(["--out", str(tmp_path / "plain"), "--no-chat-template"]) == 0
    plain = tmp_path / "plain"
    assert not (plain / "chat_template.jinja").exists()
    assert AutoTokenizer.from_pretrained(plain).chat_template is None
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (plain / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_same_seed_gives_identical_bytes(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    first = mm.make_model(tmp_path / "a", size="tiny", seed=0)
    second = mm.make_model(str(tmp_path / "b"), size="tiny", seed=0)
    other = mm.make_model(tmp_path / "c", size="tiny", seed=1)
    assert first == tmp_path / "a" and second == tmp_path / "b"
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    assert capfd.readouterr() == ("", "")  # library code prints nothing without progress=True


def test_unknown_size_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model size"):
        mm.make_model(tmp_path / "x", size="huge")
    with pytest.raises(ValueError, match="seed"):
        mm.make_model(tmp_path / "x", seed=-1)
    assert not (tmp_path / "x").exists()


def test_sizes_registry() -> None:
    assert set(mm.SIZES) == {"tiny", "small", "1b"}
    small = mm.SIZES["small"]
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads) == (768, 12, 12)
    assert small.vocab_size == mm.SIZES["tiny"].vocab_size == mm.SIZES["1b"].vocab_size == 8192


def test_1b_size_has_about_a_billion_parameters() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = mm.SIZES["1b"]
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = LlamaForCausalLM(LlamaConfig(**dataclasses.asdict(spec), tie_word_embeddings=False))
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.95e9 <= n_params <= 1.1e9
    assert spec.num_attention_heads % spec.num_key_value_heads == 0


def test_bfloat16_weights_are_the_float32_ones_rounded(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = mm.make_model(tmp_path / "bf16", size="tiny", seed=0, dtype="bfloat16")
    bf16 = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    fp32 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert torch.equal(bf16.lm_head.weight, fp32.lm_head.weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        mm.make_model(tmp_path / "x", dtype="int8")


@torch.no_grad()
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generation_has_clear_winners(model, tokenizer, prompt: str) -> None:
    enc = tokenizer(prompt, return_tensors="pt")
    top2 = model(**enc).logits[0, -1].topk(2)
    assert float(top2.values[0] - top2.values[1]) > 1e-3
    out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    new = out[0, enc.input_ids.shape[1] :].tolist()
    assert len(new) == 16
    assert new[0] == int(top2.indices[0])
    assert all(0 <= t < model.config.vocab_size for t in new)
    assert len(set(new)) > 1  # not a single token forever


def test_cli_arguments_and_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    mm.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "m")])
    assert (args.size, args.seed, args.out) == ("tiny", 0, tmp_path / "m")
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "x", "--size", "huge"])
    with pytest.raises(SystemExit) as exc:
        mm.main(["--help"])
    assert exc.value.code == 0
    assert "--seed" in capsys.readouterr().out
    assert mm.main(["--out", str(tmp_path / "m"), "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "m")
    assert "tokenizer" in captured.err and "model" in captured.err
    assert (tmp_path / "m" / "model.safetensors").is_file()
