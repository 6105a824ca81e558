"""On CPU, linear layers run through oneDNN with their weights reordered once, at load (float32;
bfloat16 where the CPU has native bf16).

Why: ``F.linear`` hands the weight to a GEMM that repacks it on every call. At decode batch sizes
(a few dozen rows) that repacking, and reading the weight cold from memory after attention has
streamed the KV cache through the caches, cost as much as the arithmetic: inside the engine the
linear layers ran at about half the rate the same shapes reach in a warm loop. With the weight
prepacked in oneDNN's blocked layout, measured on the tiny model's workload, ``lm_head`` took 40 %
less time; on the small model every linear layer together took 13 % less.

The original weight stays the module's ``weight`` (tied embeddings, ``state_dict`` and code that reads
the shape keep working); the packed copy is an extra buffer, as large as the weight.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.kernels.small_gemm import SmallGemm

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed copy of its weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.register_buffer("packed", packed, persistent=False)
        self.small = SmallGemm.for_weight(linear.weight, linear.bias)  # decode sizes, bf16

    def release_packed(self) -> None:
        """Drop the packed copies (its weight is packed elsewhere, fused with others); forward uses ``weight``."""
        self.packed = None
        self.small = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and self.small.serves(x):
            return self.small(x)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """float32 on any oneDNN build; bfloat16 only where the CPU has native bf16 (AVX-512 BF16, AMX).

    Without native bf16 (AVX2), oneDNN emulates it and torch's own path was no slower, so bfloat16
    stays there. With it, packed bf16 layers took 1.2-1.6x less time than ``F.linear`` at the
    models' decode shapes (AMX Xeon, 2026-12-01, docs/performance.md).
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module) -> int:
    """Replace every CPU ``nn.Linear`` that ``can_pack`` with a ``PackedLinear``; return how many."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_pack(child.weight.device, child.weight.dtype)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    log.info("packed %d linear layers for oneDNN", len(swaps))
    return len(swaps)
