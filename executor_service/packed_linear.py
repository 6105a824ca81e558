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

Both ops are torch's private ones (``torch_private``): a backend packs only where
``GuardedOps.probe`` found them present and agreeing with ``F.linear``; elsewhere layers stay
``nn.Linear``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.guarded_ops import GuardedOps
from executor_service.kernels.small_gemm import SmallGemm
from executor_service.torch_private import onednn_linear, reorder_linear_weight

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed copy of its weight.

    Construct one only where ``GuardedOps.packed_linear`` holds; ``small_gemm`` only where
    ``GuardedOps.small_gemm`` does.
    """

    def __init__(self, linear: nn.Linear, small_gemm: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        packed = reorder_linear_weight(linear.weight.detach())
        self.register_buffer("packed", packed, persistent=False)
        # Decode sizes in bf16 (None where the layer is too large or has a bias).
        self.small = SmallGemm.for_weight(linear.weight, linear.bias) if small_gemm else None

    def release_packed(self) -> None:
        """Drop the packed copies (its weight is packed elsewhere, fused with others); forward uses ``weight``."""
        self.packed = None
        self.small = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and self.small.serves(x):
            return self.small(x)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, self.packed, self.bias)


def pack_linears(model: nn.Module, ops: GuardedOps) -> int:
    """Replace every CPU ``nn.Linear`` of ``ops.dtype`` with a ``PackedLinear`` where ``ops`` allows; count them."""
    if not ops.packed_linear:
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == ops.dtype
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, ops.small_gemm))
    log.info("packed %d linear layers for oneDNN", len(swaps))
    return len(swaps)
