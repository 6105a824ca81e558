"""The reference backend: transformers' own forward, with Baton's paged attention plugged in.

Why it exists beside the faster ones: it serves any model whose attention goes through
transformers' attention interface (``paged_attention.register``), with nothing but public torch
ops, so it is the default for whatever the others cannot compute exactly, and the plain path the
others are checked against. Decodes read their contexts in place on the CPU (copying a context
costs more there than attending to it) and gathered into one batch elsewhere (one kernel launch
instead of one per request).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from executor_service.backends.base import Backend, BackendSupport, DecodeRead

if TYPE_CHECKING:
    from torch import nn

    from executor_service.paged_attention import AttentionBatch


class TorchBackend(Backend):
    name = "torch"
    support = BackendSupport(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        sliding_window=True,
        attn_logit_softcapping=True,  # paged_attention.attend computes it, as transformers' eager attention
        attention_sinks=True,  # and these, as gpt-oss's eager attention
    )

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, private_torch: bool = True) -> None:
        super().__init__(model, device, dtype, private_torch)
        self.decode_read = DecodeRead.IN_PLACE if device.type == "cpu" else DecodeRead.GATHERED

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        ids, places = input_ids[None], positions[None]
        output = self.model(input_ids=ids, position_ids=places, use_cache=False, logits_to_keep=keep, baton_batch=batch)
        return output.logits[0]

    def describe(self) -> str:
        return f"transformers' forward, decode attention {self.decode_read.value} (torch SDPA)"
