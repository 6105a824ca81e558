"""transformers' forward on the CPU with the native decode-attention kernel and packed linear layers.

For any model on the CPU that the lean Llama forward (``cpu_native``) does not cover: Qwen, Phi-3.
The model's own modules run; under them, every decode of a step attends in one call of the native
paged kernel per layer (``kernels/decode_attention.c``), which cuts each context to a sliding
window where a layer has one, and linear layers run through oneDNN over weights packed at load
(``packed_linear.py``), where torch's private ops for it pass their self-test (``guarded_ops.py``).
A missing compiler or a failed self-test leaves the torch path for that piece (SDPA per request,
``F.linear``), logged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from executor_service.backends.base import BackendSupport, DecodeRead
from executor_service.backends.torch_reference import TorchBackend
from executor_service.guarded_ops import GuardedOps
from executor_service.kernels import decode_attention
from executor_service.packed_linear import pack_linears

if TYPE_CHECKING:
    from torch import nn

CPU_DTYPES = frozenset({torch.float32, torch.bfloat16})  # what the native kernels and oneDNN packing serve


class CpuTransformersBackend(TorchBackend):
    name = "cpu_transformers"
    # The native kernel cuts each decode's context to a sliding window itself.
    support = BackendSupport(devices=frozenset({"cpu"}), dtypes=CPU_DTYPES, sliding_window=True)

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, private_torch: bool = True) -> None:
        super().__init__(model, device, dtype, private_torch)
        self.ops = GuardedOps.probe(device, dtype, private_torch)
        self.packed_layers = pack_linears(model, self.ops)
        if decode_attention.available(device, dtype):
            self.decode_read = DecodeRead.NATIVE

    def _linear_path(self) -> str:
        if not self.ops.packed_linear:
            return "F.linear"
        return "oneDNN prepacked" + (" + BRGeMM small GEMM" if self.ops.small_gemm else "")

    def describe(self) -> str:
        return f"transformers' forward, decode attention {self.decode_read.value}, linear layers {self._linear_path()}"
