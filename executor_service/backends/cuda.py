"""The CUDA slot: the lean Llama forward in plain torch ops, decodes read in place or gathered.

What Baton runs on a GPU for Llama and Mistral models today; other models on CUDA take the
reference backend (``torch_reference``). Nothing here is CUDA code of Baton's own: the lean
forward's torch path, the gathered decodes and the in-place reads' step building are the ones the
tests run on the CPU (``tests/executor_service/backends``), and the one CUDA kernel it calls beyond
torch's usual ops, torch's paged FlashAttention, is checked against the gathered reads at start and
by the GPU tests; so its declared support is no wider than what they check. Fused CUDA layer ops
would go here, with their own declared support.

Decode attention: where torch's FlashAttention can read the paged pool in place (float16 or
bfloat16, blocks of a multiple of 256 tokens: ``paged_decode.unavailable``) and its self-test at
start agrees with the gathered reads, every full-attention layer's decodes are one call of it
(``DecodeRead.PAGED``); otherwise, and for windowed layers, the decodes' blocks are gathered into one
padded batch for SDPA. The log says which, and why.

Static shapes: decode-only steps are padded to batch buckets and table-width buckets
(``decode_step.py``), so the model runner captures them as CUDA graphs (``decode_graphs.py``,
``executor.cuda_graphs``); the tests run the same padded path eagerly on the CPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from executor_service import paged_decode
from executor_service.backends.base import Backend, BackendSupport, DecodeRead
from executor_service.backends.cpu_native import LLAMA_LAYOUTS
from executor_service.fast_llama import FastLlamaForward

if TYPE_CHECKING:
    from torch import nn

    from executor_service.kv_cache import KVPool
    from executor_service.paged_attention import AttentionBatch
    from executor_service.sliding_window import SlidingWindow

log = logging.getLogger(__name__)


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
        self.gather_reason = "wait for the KV pool"  # why decodes are gathered, for the log (after "in-place reads")

    def bind_kv(self, pool: KVPool, window: SlidingWindow | None) -> None:
        heads, kv_heads, head_dim = self.lean.heads, self.lean.kv_heads, self.lean.head_dim
        reason = paged_decode.unavailable(self.device, self.dtype, pool.block_size, head_dim)
        if reason is None and window is not None and window.every_layer:
            reason = "serve full-attention layers only, and every layer here is windowed"
        if reason is None:
            reason = paged_decode.self_test(self.device, self.dtype, pool.block_size, heads, kv_heads, head_dim)
            if reason is not None:
                reason = f"failed their self-test: {reason}"
                log.warning("in-place paged decode attention (torch FlashAttention) not used: %s", reason)
        self.gather_reason = reason or ""
        self.decode_read = DecodeRead.GATHERED if reason else DecodeRead.PAGED

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        return self.lean(input_ids, positions, keep, batch)

    def describe(self) -> str:
        if self.decode_read is DecodeRead.PAGED:
            attention = "paged in place (torch FlashAttention; windowed layers gathered)"
        else:
            attention = f"gathered (torch SDPA; in-place reads {self.gather_reason})"
        return f"lean Llama forward (torch ops), decode attention {attention}, static-shape decode steps"
