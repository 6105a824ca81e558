"""The fastest CPU path, for Llama-layout models: the lean forward with native kernels.

The lean Llama forward (``fast_llama.py``: q/k/v and gate/up fused into one matmul each, the final
norm on sampled rows only), its elementwise work in native calls (``kernels/layer_ops.c``:
residual add + RMSNorm, RoPE with the K/V write, SiLU-and-multiply), every decode in one call of the
native paged kernel per layer, and linear layers through oneDNN over packed weights (with torch's
BRGeMM micro-kernel for small bf16 layers at decode sizes), the last two only where torch's
private ops pass their self-test (``guarded_ops.py``). Whatever this host lacks falls back to
torch ops piece by piece, as in ``cpu_transformers``; the log says which.

Declared for Llama and Mistral (the same layout, Mistral's sliding window included) with SiLU MLPs:
the layouts the lean forward reproduces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from executor_service.backends.base import BackendSupport
from executor_service.backends.cpu_transformers import CPU_DTYPES, CpuTransformersBackend
from executor_service.fast_llama import FastLlamaForward

if TYPE_CHECKING:
    from torch import nn

    from executor_service.paged_attention import AttentionBatch

LLAMA_LAYOUTS = frozenset({"llama", "mistral"})


class CpuNativeBackend(CpuTransformersBackend):
    name = "cpu_native"
    support = BackendSupport(
        devices=frozenset({"cpu"}),
        dtypes=CPU_DTYPES,
        model_types=LLAMA_LAYOUTS,
        hidden_acts=frozenset({"silu"}),
        sliding_window=True,
    )

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, private_torch: bool = True) -> None:
        super().__init__(model, device, dtype, private_torch)
        self.lean = FastLlamaForward(model, self.ops.small_gemm)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        return self.lean(input_ids, positions, keep, batch)

    def describe(self) -> str:
        layer_ops = "native" if self.lean.native_layer_ops else "torch"
        return (
            f"lean Llama forward, layer ops {layer_ops}, decode attention {self.decode_read.value}, "
            f"linear layers {self._linear_path()}"
        )
