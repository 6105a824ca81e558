"""The CUDA slot: the lean Llama forward in plain torch ops, decodes gathered into one batch.

What Baton runs on a GPU for Llama and Mistral models today; other models on CUDA take the
reference backend (``torch_reference``). Nothing here is CUDA-specific code: the lean forward's
torch path and the gathered decodes are the ones the tests run on the CPU (``tests/executor_service/
backends``), so its declared support is no wider than what they check. CUDA kernels of Baton's own
(a paged decode kernel, fused layer ops) would go here, with their own declared support.

Static shapes: decode-only steps are padded to batch buckets and table-width buckets
(``decode_step.py``), so the model runner captures them as CUDA graphs (``decode_graphs.py``,
``executor.cuda_graphs``); the tests run the same padded path eagerly on the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from executor_service.backends.base import Backend, BackendSupport, DecodeRead
from executor_service.backends.cpu_native import LLAMA_LAYOUTS
from executor_service.fast_llama import FastLlamaForward

if TYPE_CHECKING:
    from torch import nn

    from executor_service.paged_attention import AttentionBatch


class CudaBackend(Backend):
    name = "cuda"
    support = BackendSupport(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        model_types=LLAMA_LAYOUTS,
        hidden_acts=frozenset({"silu"}),
        sliding_window=True,  # the lean forward passes Mistral's window; the padded gathers cut to it
    )

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, private_torch: bool = True) -> None:
        super().__init__(model, device, dtype, private_torch)
        self.decode_read = DecodeRead.GATHERED
        self.static_shapes = True
        self.lean = FastLlamaForward(model)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        return self.lean(input_ids, positions, keep, batch)

    def describe(self) -> str:
        return (
            f"lean Llama forward (torch ops), decode attention {self.decode_read.value} (torch SDPA), "
            "static-shape decode steps"
        )
