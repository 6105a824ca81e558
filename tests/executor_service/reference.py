"""Reference greedy outputs from ``model.generate`` on each prompt alone, with the tie allowance."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, GenerationMixin

TIE_EPSILON = 1e-4


@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    # Gap between the top-2 logits at each generated position.
    gaps: list[float]


def load_reference_model(model_dir: Path) -> GenerationMixin:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # generate() fills a config's unset fields from the model's own: without this, the reference
    # stops at the model's EOS even when asked for none (``reference_greedy``), as Baton's requests
    # with ignore_eos do not.
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def reference_greedy(model: GenerationMixin, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None
    )
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        generation_config=config,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    gaps = []
    for step_logits in out.logits:
        top2 = torch.topk(step_logits[0].float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return Reference(tokens, gaps)


def assert_matches_reference(got: list[int], ref: Reference, label: str = "") -> None:
    """Token-for-token equality, except from a position where the reference had a near-tie."""
    for i, (a, b) in enumerate(zip(got, ref.tokens, strict=False)):
        if a != b:
            if ref.gaps[i] < TIE_EPSILON:
                return  # a legitimate near-tie: the sequences may diverge from here
            raise AssertionError(f"{label}: token {i} differs: got {a}, reference {b} (gap {ref.gaps[i]:.2e})")
    if len(got) != len(ref.tokens):
        raise AssertionError(f"{label}: got {len(got)} tokens, reference {len(ref.tokens)}")
