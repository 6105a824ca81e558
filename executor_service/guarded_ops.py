"""Which of torch's private ops (``torch_private``) an executor uses: each only where it resolves and
its self-test at start agrees with the public op it stands in for.

Why a self-test and not a version check alone: a private op may change what it computes, not only
its name, and a torch build (CUDA wheel, another oneDNN, another CPU) may differ from the one these
were measured on. Each test runs the private op on small random layers, at the row counts the
engine uses (one decode, a few, a prefill chunk past the micro-kernel's 64 rows, a 3-D batch), and
compares with ``F.linear`` on the same inputs:

- float32: within ``1e-5`` of the sum of the absolute products (``|x| @ |W|^T + |b|``), the room that
  summing in another order takes (the public op and oneDNN block the sums differently);
- bfloat16: the same, plus one bf16 rounding step (``2^-7`` of the value), as the two round their
  float32 sums to bf16 each on its own.

A failure (a wrong value, a NaN, a wrong shape or dtype, an exception) keeps the public op for
the whole run and says why in the log; so does ``executor.torch_private_ops: false``. Where a
private op is in use, greedy output is still checked against ``model.generate`` by the tests, and
so is the public path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor_service.kernels import small_gemm_library
from executor_service.kernels.small_gemm import MAX_ROWS, SmallGemm
from executor_service.torch_private import (
    brgemm_bf16,
    onednn_linear,
    onednn_linear_available,
    onednn_native_bf16,
    reorder_linear_weight,
)

log = logging.getLogger(__name__)

LinearOp = Callable[[torch.Tensor], torch.Tensor]
# Builds the private op's stand-in for F.linear(x, weight, bias) from the layer's weight and bias.
MakeLinear = Callable[[torch.Tensor, torch.Tensor | None], LinearOp]

FLOAT32_TOLERANCE = 1e-5  # of |x| @ |W|^T + |b|: the sums taken in another order
BF16_ROUNDING = 2.0**-7  # of the value: one bf16 rounding step apart

# (out features, in features, with a bias): sizes that are not multiples of the kernels' blocks.
PACKED_LINEAR_LAYERS = ((24, 40, True), (48, 64, False))
PACKED_LINEAR_ROWS = ((1,), (5,), (70,), (2, 3))
SMALL_GEMM_LAYERS = ((40, 64, False), (24, 34, False))
SMALL_GEMM_ROWS = ((1,), (17,), (MAX_ROWS,))


def _onednn(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearOp:
    packed = reorder_linear_weight(weight)
    return lambda x: onednn_linear(x, packed, bias)


def _small_gemm(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearOp:
    return SmallGemm(weight)


def agrees(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``got`` is ``F.linear(x, weight, bias)`` within the stated tolerance for its dtype."""
    want = F.linear(x, weight, bias)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    magnitude = x.float().abs() @ weight.float().abs().t()
    if bias is not None:
        magnitude = magnitude + bias.float().abs()
    bound = FLOAT32_TOLERANCE * magnitude
    if want.dtype == torch.bfloat16:
        bound = bound + BF16_ROUNDING * want.float().abs()
    return bool(((got.float() - want.float()).abs() <= bound).all())  # a NaN compares False


def self_test(
    make: MakeLinear,
    dtype: torch.dtype,
    layers: tuple[tuple[int, int, bool], ...],
    rows: tuple[tuple[int, ...], ...],
) -> str | None:
    """None when ``make``'s op agrees with ``F.linear`` on every layer and row shape; else what went wrong."""
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features, with_bias in layers:
        weight = (torch.randn(out_features, in_features, generator=generator) * 0.1).to(dtype)
        bias = (torch.randn(out_features, generator=generator) * 0.1).to(dtype) if with_bias else None
        for shape in rows:
            x = torch.randn(*shape, in_features, generator=generator).to(dtype)
            try:
                got = make(weight, bias)(x)
            except Exception as exc:  # an unknown private op may fail in any way; each means "do not use it"
                return f"[{out_features}x{in_features}] on {(*shape, in_features)} raised {type(exc).__name__}: {exc}"
            if not agrees(got, x, weight, bias):
                return f"[{out_features}x{in_features}] on {(*shape, in_features)} disagrees with F.linear"
    return None


def packed_linear_refusal(device: torch.device, dtype: torch.dtype, make: MakeLinear = _onednn) -> str | None:
    """Why the oneDNN prepacked linear may not serve this device and dtype, or None when it may."""
    if device.type != "cpu":
        return f"not on the CPU ({device})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"used for float32 and bfloat16 only, not {str(dtype).removeprefix('torch.')}"
    if not onednn_linear_available():
        return "this torch build has no oneDNN or no mkldnn._reorder_linear_weight/_linear_pointwise"
    # Without native bf16 (AVX2) oneDNN emulates it and torch's own path was no slower. With it, packed
    # bf16 layers took 1.2-1.6x less time than F.linear at the models' decode shapes (AMX Xeon,
    # 2026-12-01, docs/performance.md).
    if dtype == torch.bfloat16 and not onednn_native_bf16():
        return "this CPU has no native bf16 (oneDNN would emulate it, no faster than F.linear)"
    failure = self_test(make, dtype, PACKED_LINEAR_LAYERS, PACKED_LINEAR_ROWS)
    return f"self-test failed: {failure}" if failure else None


def small_gemm_refusal(dtype: torch.dtype, make: MakeLinear = _small_gemm) -> str | None:
    """Why torch's bf16 BRGeMM micro-kernel may not serve small layers, or None when it may."""
    if dtype != torch.bfloat16:
        return f"used for bfloat16 only, not {str(dtype).removeprefix('torch.')}"
    if small_gemm_library() is None:
        return "its C wrapper did not build (see the warning above)"
    if brgemm_bf16() is None:
        return "torch's brgemm symbols do not resolve in this build, or the CPU has no bf16 micro-kernel"
    failure = self_test(make, dtype, SMALL_GEMM_LAYERS, SMALL_GEMM_ROWS)
    return f"self-test failed: {failure}" if failure else None


@dataclass(frozen=True)
class GuardedOps:
    """The private torch ops a CPU backend may use for its model's dtype; each passed its self-test."""

    dtype: torch.dtype = torch.float32  # the model's dtype: the verdicts hold for it
    # Linear layers over weights reordered for oneDNN at load (packed_linear.py), instead of F.linear.
    packed_linear: bool = False
    # Small bf16 layers' decode rows through torch's BRGeMM micro-kernel (kernels/small_gemm.py),
    # instead of the packed oneDNN linear; needs packed_linear (it serves only packed layers).
    small_gemm: bool = False

    @classmethod
    def probe(cls, device: torch.device, dtype: torch.dtype, allowed: bool = True) -> GuardedOps:
        """Resolve and self-test each private op for ``dtype`` on ``device``; log which path each feature takes.

        ``allowed`` False (``executor.torch_private_ops: false``) keeps every public op untested.
        """
        if not allowed:
            log.info("torch private ops off (executor.torch_private_ops): linear layers use F.linear")
            return cls(dtype)
        packed_refusal = packed_linear_refusal(device, dtype)
        _log_verdict("oneDNN prepacked linear layers (torch.ops.mkldnn private ops)", packed_refusal, "F.linear")
        if packed_refusal is not None:
            return cls(dtype)
        small_refusal = small_gemm_refusal(dtype)
        _log_verdict("bf16 BRGeMM micro-kernel for small layers (torch's C++ symbols)", small_refusal, "oneDNN")
        return cls(dtype, packed_linear=True, small_gemm=small_refusal is None)


def _log_verdict(feature: str, refusal: str | None, fallback: str) -> None:
    if refusal is None:
        log.info("%s: in use (self-test passed)", feature)
    else:
        log.info("%s: not used, %s instead: %s", feature, fallback, refusal)
