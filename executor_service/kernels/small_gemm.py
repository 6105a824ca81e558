"""Small bfloat16 linear layers at decode sizes through oneDNN's BRGeMM micro-kernel (``small_gemm.c``).

torch's oneDNN linear costs 20-30 us per call whatever its size, about as much as a small layer's
arithmetic; the micro-kernel that torch exports for its own CPU attention (``at::native::cpublas::
brgemm``) runs the same AMX code, cached per shape, for about a microsecond a call. Measured on the
AMX Xeon (2026-12-01, bfloat16, one thread; docs/performance.md, "Eleventh round"):

- alone, weights hot: the tiny model's fused q-k-v layer at 32 rows 8.5 us against 34 us, outputs
  bit for bit oneDNN's;
- inside the engine, weights cold after attention: 39-59 us against 71-91 us a call at 1-32 rows
  for the tiny model's q-k-v, o and down layers. Its gate-up layer (704 KB) and lm_head (4 MB) were
  no faster or slower there, the kernel streaming a large weight from memory less well than oneDNN's
  blocked layout, so weights over 512 KB, and more than 64 rows (prefill), stay on oneDNN.

Used only where torch says its CPU packs bf16 for the kernel (AMX, AVX512-BF16), the symbols
resolve (they are C++ names of torch's build, ``torch_private.brgemm_bf16``) and the self-test at
start passes (``guarded_ops``); anywhere else, and with more than one torch thread (the kernel runs
on the calling thread only), the layer keeps its oneDNN path.
"""

from __future__ import annotations

import torch

from executor_service.kernels import small_gemm_library
from executor_service.torch_private import brgemm_bf16

MAX_ROWS = 64  # beyond this oneDNN's own blocking was as fast or faster
MAX_WEIGHT_ELEMENTS = 1 << 18  # 512 KB of bf16: larger weights were no faster in the engine


class SmallGemm:
    """``x @ weight.T`` (bf16 in, bf16 out, float32 accumulation) for 2-D ``x`` of up to MAX_ROWS rows."""

    def __init__(self, weight: torch.Tensor) -> None:
        library, kernel = small_gemm_library(), brgemm_bf16()
        if library is None or kernel is None:
            raise RuntimeError("the small GEMM is not available")
        self.out_features, self.in_features = (int(size) for size in weight.shape)
        k, n = self.in_features, self.out_features
        # VNNI order, [k/2][n][2]: each pair of consecutive input features side by side per output.
        self.packed = weight.detach().t().reshape(k // 2, 2, n).transpose(1, 2).contiguous()
        self._call = library.baton_small_gemm_bf16
        self._brgemm, self._release = kernel

    @staticmethod
    def for_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> SmallGemm | None:
        """A SmallGemm for this layer, or None where it does not apply (the layer keeps oneDNN)."""
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or bias is not None:
            return None
        n, k = weight.shape
        if k % 2 or n * k > MAX_WEIGHT_ELEMENTS or small_gemm_library() is None or brgemm_bf16() is None:
            return None
        return SmallGemm(weight)

    def serves(self, x: torch.Tensor) -> bool:
        """Whether this call is one for the kernel: few rows, one torch thread."""
        return x.dim() == 2 and x.shape[0] <= MAX_ROWS and torch.get_num_threads() == 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        if k != self.in_features or x.dtype != torch.bfloat16 or x.stride(1) != 1 or rows > MAX_ROWS:
            raise ValueError(f"small GEMM takes [<= {MAX_ROWS}, {self.in_features}] bf16 rows, got {tuple(x.shape)}")
        n = self.out_features
        out = x.new_empty(rows, n)
        if rows == 0:
            return out
        source, weight, target = x.data_ptr(), self.packed.data_ptr(), out.data_ptr()
        failed = self._call(self._brgemm, self._release, source, rows, k, x.stride(0), weight, n, target, n)
        if failed:
            raise MemoryError("small GEMM: no memory for the accumulator")
        return out
