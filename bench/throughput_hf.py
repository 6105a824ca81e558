"""bench/throughput.py's phases (c) and (d): transformers' static ``generate`` and its continuous batching."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig

from bench.throughput_setup import (
    DTYPES,
    STATIC_BATCH,
    WARM_PROMPT,
    WARM_TOKENS,
    Result,
    Setup,
    Workload,
    finish,
    progress,
    say,
)


# ---- (c) and (d): transformers -------------------------------------------------------------
def load_hf(model_dir: Path, setup: Setup) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[setup.dtype])  # sdpa attention
    # transformers decorates .to with functools.wraps(nn.Module.to), whose stub keeps the unbound self.
    return model.to(setup.torch_device).eval()  # type: ignore[arg-type]


def hf_static_batch(model: Any, prompts: list[list[int]], new: int, pad: int) -> list[list[int]]:
    device = model.device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    # min_new_tokens: EOS cannot end a row early, so every row runs the batch's full length.
    options = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": pad}
    ids, mask = ids.to(device), mask.to(device)
    return model.generate(input_ids=ids, attention_mask=mask, **options)[:, width:].tolist()


def static_round(model: Any, wl: Workload, pad: int, bar: tqdm | None = None) -> tuple[list[list[int]], int]:
    """The workload in static batches: each request's own tokens, and the tokens computed."""
    outputs: list[list[int]] = []
    computed = 0
    for start in range(0, len(wl.prompts), STATIC_BATCH):
        wanted = wl.max_tokens[start : start + STATIC_BATCH]
        rows = hf_static_batch(model, wl.prompts[start : start + STATIC_BATCH], max(wanted), pad)
        outputs += [row[:n] for row, n in zip(rows, wanted, strict=True)]
        computed += len(rows) * max(wanted)
        if bar is not None:
            bar.update(len(rows))
    return outputs, computed


def run_hf_static(model_dir: Path, wl: Workload, setup: Setup) -> Result:
    model = load_hf(model_dir, setup)
    pad = int(model.generation_config.pad_token_id)
    hf_static_batch(model, [WARM_PROMPT, WARM_PROMPT[:5]], WARM_TOKENS, pad)
    if setup.warm_workload:
        say(f"(c) warm-up: the workload once in static batches of {STATIC_BATCH}, untimed")
        static_round(model, wl, pad)
    with progress(len(wl.prompts), f"(c) HF generate, static batches of {STATIC_BATCH}") as bar:
        started = time.perf_counter()
        outputs, computed = static_round(model, wl, pad, bar)
        seconds = time.perf_counter() - started
    note = "each batch runs to its longest output; only each request's own tokens count"
    return finish(f"(c) HF generate, static {STATIC_BATCH}", seconds, outputs, wl, computed, note)


def run_hf_cb(model_dir: Path, wl: Workload, setup: Setup) -> Result:
    label, longest = "(d) HF generate_batch (CB)", max(wl.max_tokens)
    try:
        model = load_hf(model_dir, setup)
        pad = int(model.generation_config.pad_token_id)
        options = {"do_sample": False, "eos_token_id": -1, "pad_token_id": pad}  # eos -1: never stop early
        warm = GenerationConfig(max_new_tokens=WARM_TOKENS, **options)
        model.generate_batch(inputs=[WARM_PROMPT, WARM_PROMPT[:5]], generation_config=warm)
        if setup.warm_workload:
            say("(d) warm-up: the workload once, untimed")
            model.generate_batch(wl.prompts, GenerationConfig(max_new_tokens=longest, **options))
        say(f"(d) HF generate_batch (continuous batching), max_new_tokens={longest} for every request")
        called = time.perf_counter()
        results = model.generate_batch(wl.prompts, GenerationConfig(max_new_tokens=longest, **options))
        call_seconds = time.perf_counter() - called
        got = list(results.values())
        if len(got) != len(wl.prompts) or any(r.error for r in got):
            raise RuntimeError(f"{len(got)} results, errors: {[r.error for r in got if r.error][:3]}")
        # First submit (request creation) to last finish, as in (a)-(c); the call also built its KV cache.
        seconds = max(r.lifespan[1] for r in got) - min(r.created_time for r in got)
        outputs = [r.generated_tokens[:n] for r, n in zip(got, wl.max_tokens, strict=True)]
        computed = sum(len(r.generated_tokens) for r in got)
        note = (
            f"generate_batch takes one max_new_tokens, so every request ran {longest} tokens; only each "
            f"request's own tokens count; whole call incl. setup {call_seconds:.1f} s"
        )
        return finish(label, seconds, outputs, wl, computed, note)
    except Exception as exc:
        say(f"(d) failed: {exc!r}")
        return Result(label, note=f"n/a: {type(exc).__name__}: {exc}")
