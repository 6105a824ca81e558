"""The engine in bfloat16 on the generated tiny model: the native paths' logits against torch's, step by step.

Greedy exactness against ``model.generate`` is float32's (test_engine.py); in bfloat16 the native
layer ops, the small GEMM and the prefill kernel must agree with the torch ops, oneDNN and SDPA to bf16
precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from executor_service.backends.cpu_native import CpuNativeBackend
from executor_service.engine import Engine
from executor_service.engine_io import PlanUpdate
from executor_service.kernels.small_gemm import MAX_ROWS, SmallGemm
from executor_service.step_scheduler import ScheduledChunk
from executor_service.torch_private import brgemm_bf16
from tests.executor_service.test_engine import admit, make_engine

SHORT_PROMPTS = [[1, 17, 300, 4000, 25], [1, 9, 8, 7, 6, 5, 4, 3], [1, 1234]]


def _logits_per_step(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The logits of each step (a prefill, then decodes) of SHORT_PROMPTS run to 4 tokens each."""
    captured: list[torch.Tensor] = []
    real_run = engine.runner.run

    def run(chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        captured.append(real_run(chunks))
        return captured[-1]

    monkeypatch.setattr(engine.runner, "run", run)
    engine.apply(PlanUpdate(seq=1, admit=tuple(admit(f"r{i}", p, 4) for i, p in enumerate(SHORT_PROMPTS))))
    while engine.has_work:
        engine.step()
    return captured


def _assert_same_logits_to_bf16_precision(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) == 4
    for step, reference in zip(got, want, strict=True):
        assert step.shape == reference.shape == (3, step.shape[1])
        if not torch.equal(step.argmax(-1), reference.argmax(-1)):
            break  # a near-tie went the other way: later steps read different tokens
        torch.testing.assert_close(step, reference, atol=0.01 * float(reference.abs().max()), rtol=0)


def test_bfloat16_native_layer_ops_give_the_torch_ops_logits(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In bfloat16 the native norm, RoPE and SiLU round where torch's ops round: the logits of each
    step (prefill, then decodes) agree with those of the torch elementwise ops to bf16 precision."""
    steps: dict[bool, list[torch.Tensor]] = {}
    for native in (True, False):
        engine = make_engine(tiny_model_dir, dtype="bfloat16")
        backend = engine.runner.backend
        if not isinstance(backend, CpuNativeBackend) or not backend.lean.native_layer_ops:
            pytest.skip("no native layer ops here")
        backend.lean.native_layer_ops = native
        steps[native] = _logits_per_step(engine, monkeypatch)
    _assert_same_logits_to_bf16_precision(steps[True], steps[False])


@pytest.mark.skipif(brgemm_bf16() is None, reason="no bf16 BRGeMM micro-kernel on this CPU")
def test_bfloat16_small_gemm_gives_the_onednn_logits(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On one thread the small layers' decode rows go through the micro-kernel; the logits agree with
    oneDNN's for every layer to bf16 precision."""
    before = torch.get_num_threads()
    calls: list[int] = []
    real_call = SmallGemm.__call__

    def counted(self: SmallGemm, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return real_call(self, x)

    monkeypatch.setattr(SmallGemm, "__call__", counted)
    try:
        with_kernel = _logits_per_step(make_engine(tiny_model_dir, dtype="bfloat16", torch_threads=1), monkeypatch)
        assert calls and max(calls) <= MAX_ROWS, "the decode steps used the micro-kernel"
        monkeypatch.setattr(SmallGemm, "serves", lambda self, x: False)
        onednn = _logits_per_step(make_engine(tiny_model_dir, dtype="bfloat16", torch_threads=1), monkeypatch)
    finally:
        torch.set_num_threads(before)
    _assert_same_logits_to_bf16_precision(with_kernel, onednn)


def test_bfloat16_native_prefill_gives_the_sdpa_logits(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt chunks through the native prefill kernel (keys read in place) give the logits of the
    gathered-context SDPA path, step by step, to bf16 precision."""
    steps: dict[bool, list[torch.Tensor]] = {}
    for native in (True, False):
        engine = make_engine(tiny_model_dir, dtype="bfloat16")
        if not engine.runner.native_prefill:
            pytest.skip("no native prefill kernel here (it needs AVX512-BF16)")
        engine.runner.native_prefill = native
        steps[native] = _logits_per_step(engine, monkeypatch)
    _assert_same_logits_to_bf16_precision(steps[True], steps[False])
