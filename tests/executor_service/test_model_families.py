"""Every architecture ``baton make-model --arch`` builds is served exactly: greedy output equals
``model.generate`` on the prompt alone, token for token, in float32, with staggered joins."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from baton.make_model import make_model
from executor_service.backends.base import DecodeRead
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.executor_service.test_engine import admit, make_engine, run_to_end

# The backend the registry picks for each on the CPU in float32: the lean Llama forward where it
# applies (Mistral's sliding window included), transformers' forward with the native kernels for the
# rest, and the reference for Gemma 2's soft-capped attention (which the native decode kernel does
# not compute) and gpt-oss's attention sinks (which neither native kernel computes): its windowed
# layers bite here, as its window is 64 tokens. Windows beyond these: test_sliding_window.py.
SERVED = {
    "llama": "cpu_native",
    "qwen2": "cpu_transformers",
    "qwen3": "cpu_transformers",
    "mistral": "cpu_native",
    "phi3": "cpu_transformers",
    "gemma2": "torch",
    "gpt_oss": "torch",
}


@pytest.mark.parametrize("arch", SERVED)
def test_staggered_greedy_matches_generate_alone(arch: str, tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / arch, arch=arch)
    engine = make_engine(model_dir, token_budget=64)  # several prefill chunks for the longer prompts
    assert engine.runner.backend.name == SERVED[arch]
    _assert_staggered_greedy_exact(engine, model_dir, arch)


@pytest.mark.parametrize("read", ["gathered", "scattered"])
def test_attention_sinks_are_exact_on_every_decode_read(
    read: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's sinks on the decode reads the family test above does not take: one gathered batch
    (CUDA's), and blocks scattered over the pool (each decode's context gathered)."""
    model_dir = make_model(tmp_path / "gpt_oss", arch="gpt_oss")
    engine = make_engine(model_dir, token_budget=64)
    if read == "gathered":
        monkeypatch.setattr(engine.runner, "decode_read", DecodeRead.GATHERED)
    else:
        monkeypatch.setattr(engine.allocator, "contiguous_start", lambda table: None)
    _assert_staggered_greedy_exact(engine, model_dir, "gpt_oss")


def _assert_staggered_greedy_exact(engine: Engine, model_dir: Path, arch: str) -> None:
    rng = random.Random(5)
    prompts = {f"{arch}-{i}": [1] + [rng.randrange(5, 8000) for _ in range(rng.randrange(3, 120))] for i in range(5)}
    lengths = {rid: rng.randrange(4, 24) for rid in prompts}
    arrivals: dict[int, list[AdmitSpec]] = {}
    for step, rid in zip([0, 0, 1, 3, 6], prompts, strict=True):
        arrivals.setdefault(step, []).append(admit(rid, prompts[rid], lengths[rid]))
    got = run_to_end(engine, arrivals)
    reference = load_reference_model(model_dir)
    for rid, prompt in prompts.items():
        assert_matches_reference(got[rid], reference_greedy(reference, prompt, lengths[rid]), rid)
