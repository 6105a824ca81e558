"""torch's private ops are used only after their self-test at start; a failing or refused one leaves
the public op, and greedy output stays ``model.generate``'s either way."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from executor_service import guarded_ops
from executor_service.backends.cpu_native import CpuNativeBackend
from executor_service.engine import Engine
from executor_service.guarded_ops import (
    PACKED_LINEAR_LAYERS,
    PACKED_LINEAR_ROWS,
    GuardedOps,
    LinearOp,
    agrees,
    packed_linear_refusal,
    self_test,
    small_gemm_refusal,
)
from executor_service.packed_linear import PackedLinear
from executor_service.torch_private import brgemm_bf16, onednn_linear_available, onednn_native_bf16
from tests.executor_service.test_engine import assert_staggered_batch_exact, make_engine

CPU = torch.device("cpu")


def _public(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearOp:
    return lambda x: F.linear(x, weight, bias)


def _off_by(relative: float) -> guarded_ops.MakeLinear:
    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearOp:
        return lambda x: F.linear(x, weight, bias) * (1 + relative)

    return make


def _raises(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearOp:
    def op(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("unknown overload")

    return op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_public_op_passes_its_own_self_test(dtype: torch.dtype) -> None:
    assert self_test(_public, dtype, PACKED_LINEAR_LAYERS, PACKED_LINEAR_ROWS) is None


@pytest.mark.parametrize(
    ("make", "dtype", "failure"),
    [
        (_off_by(1e-3), torch.float32, "disagrees with F.linear"),
        (_off_by(2**-5), torch.bfloat16, "disagrees with F.linear"),
        (_off_by(float("nan")), torch.float32, "disagrees with F.linear"),
        (lambda w, b: lambda x: F.linear(x, w, b).double(), torch.float32, "disagrees with F.linear"),
        (lambda w, b: lambda x: F.linear(x, w, b)[..., :-1], torch.float32, "disagrees with F.linear"),
        (_raises, torch.float32, "raised RuntimeError: unknown overload"),
    ],
    ids=["float32-off", "bf16-off", "nan", "dtype", "shape", "raises"],
)
def test_a_private_op_that_misbehaves_fails_its_self_test(
    make: guarded_ops.MakeLinear, dtype: torch.dtype, failure: str
) -> None:
    assert failure in (self_test(make, dtype, PACKED_LINEAR_LAYERS, PACKED_LINEAR_ROWS) or "")
    if onednn_linear_available():
        assert failure in (packed_linear_refusal(CPU, torch.float32, make) or "")


def test_the_tolerance_is_the_stated_one() -> None:
    """float32: 1e-5 of |x| @ |W|^T + |b|; bfloat16: that plus one bf16 rounding step (2^-7)."""
    torch.manual_seed(0)
    x, weight = torch.randn(3, 16), torch.randn(8, 16)
    magnitude = x.abs() @ weight.abs().t()
    want = F.linear(x, weight)
    assert agrees(want + 0.9e-5 * magnitude, x, weight, None)
    assert not agrees(want + 1.1e-5 * magnitude, x, weight, None)
    xb, wb = x.bfloat16(), weight.bfloat16()
    exact = F.linear(xb, wb)
    assert agrees((exact.float() * (1 + 2**-8)).bfloat16(), xb, wb, None)
    assert not agrees((exact.float() * (1 + 2**-5)).bfloat16(), xb, wb, None)


def test_the_private_ops_pass_here_where_they_resolve() -> None:
    """This machine runs the torch the project pins: what resolves here also passes its self-test."""
    if onednn_linear_available():
        assert packed_linear_refusal(CPU, torch.float32) is None
        assert GuardedOps.probe(CPU, torch.float32) == GuardedOps(torch.float32, packed_linear=True)
    if onednn_native_bf16():
        assert packed_linear_refusal(CPU, torch.bfloat16) is None
    if brgemm_bf16() is not None:
        assert small_gemm_refusal(torch.bfloat16) is None
        assert GuardedOps.probe(CPU, torch.bfloat16).small_gemm == onednn_native_bf16()
    assert "bfloat16 only" in (small_gemm_refusal(torch.float32) or "")
    assert "not on the CPU" in (packed_linear_refusal(torch.device("cuda"), torch.float32) or "")


def test_switched_off_nothing_private_is_probed() -> None:
    assert GuardedOps.probe(CPU, torch.bfloat16, allowed=False) == GuardedOps(torch.bfloat16)


def _native(engine: Engine) -> CpuNativeBackend:
    backend = engine.runner.backend
    assert isinstance(backend, CpuNativeBackend)
    return backend


def test_with_private_ops_off_the_engine_runs_public_ops_and_matches_generate(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, torch_private_ops=False)
    backend = _native(engine)
    assert backend.ops == GuardedOps(torch.float32)
    assert not any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())
    assert not any(fused.packed for layer in backend.lean.layers for fused in (layer.qkv, layer.gate_up))
    assert_staggered_batch_exact(engine, tiny_model_dir)


@pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN linear in this torch build")
def test_a_failed_self_test_keeps_the_public_op_and_says_so(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = guarded_ops.onednn_linear
    monkeypatch.setattr(guarded_ops, "onednn_linear", lambda x, packed, bias: real(x, packed, bias) + 1)
    with caplog.at_level(logging.INFO, logger="executor_service.guarded_ops"):
        engine = make_engine(tiny_model_dir)
    assert "not used, F.linear instead: self-test failed" in caplog.text
    assert _native(engine).ops == GuardedOps(torch.float32)
    assert not any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())
    assert_staggered_batch_exact(engine, tiny_model_dir)
