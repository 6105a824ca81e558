"""Attention over the paged KV cache, plugged into transformers through ``AttentionInterface``.

Why our own kernel: transformers' continuous-batching paths (``sdpa``, ``paged|eager``) pack
all requests into one sequence under a [total queries x total keys] block-diagonal mask, so
on CPU a step costs O(requests^2). Here each prefill chunk attends only to its own context
and all decodes share one padded, batched SDPA call: O(tokens x own context).

The model runs one packed sequence [1, N] per step; the model computes Q/K/V and RoPE as usual
(any HF model using the attention interface works), and this function writes the new K/V into
the pool and attends per request. Step metadata arrives through the ``baton_batch`` kwarg,
which transformers passes down to attention untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from executor_service.kv_cache import KVPool

ATTENTION_NAME = "baton_paged"


@dataclass(frozen=True)
class PrefillSegment:
    """One request's chunk of query tokens within the packed step."""

    start: int  # first query row in the packed sequence
    end: int  # one past the last query row
    # Slots of the request's whole context (cached prefix + this chunk), or None when the chunk
    # is the request's entire context (a fresh prefill): then it attends to its own K/V directly.
    context_slots: torch.Tensor | None
    # Boolean [chunk, context] mask, True where attention is allowed; None for a fresh prefill.
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeGroup:
    """All single-token decodes of the step, attended in one padded batch."""

    rows: torch.Tensor  # [D] query rows in the packed sequence
    context_slots: torch.Tensor  # [D, L] slots, padded with slot 0
    mask: torch.Tensor  # [D, 1, 1, L] True for real context positions


@dataclass(frozen=True)
class AttentionBatch:
    """What attention needs to know about one packed step."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [N] where each query token's K/V is written
    prefills: tuple[PrefillSegment, ...]
    decodes: DecodeGroup | None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, H, N, d], key/value [1, Hkv, N, d] -> output [1, N, H, d]."""
    batch: AttentionBatch = kwargs["baton_batch"]
    layer = int(getattr(module, "layer_idx", 0))
    keys, values = batch.pool.keys[layer], batch.pool.values[layer]
    new_keys, new_values = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [N, Hkv, d]
    keys[batch.slot_mapping] = new_keys
    values[batch.slot_mapping] = new_values
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [N, H, d]
    gqa = query.shape[1] != key.shape[1]
    for seg in batch.prefills:
        q = query[:, :, seg.start : seg.end]
        if seg.context_slots is None:
            k, v = key[:, :, seg.start : seg.end], value[:, :, seg.start : seg.end]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            k = keys[seg.context_slots].transpose(0, 1).unsqueeze(0)
            v = values[seg.context_slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, scale=scaling, enable_gqa=gqa)
        out[seg.start : seg.end] = o[0].transpose(0, 1)
    if batch.decodes is not None:
        group = batch.decodes
        q = query[0, :, group.rows].transpose(0, 1).unsqueeze(2)  # [D, H, 1, d]
        k = keys[group.context_slots].transpose(1, 2)  # [D, Hkv, L, d]
        v = values[group.context_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scaling, enable_gqa=gqa)
        out[group.rows] = o.squeeze(2)
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # Masks are built per request inside paged_attention; the model must not build a global one.
    return None


def register() -> str:
    """Register the attention function (idempotent) and return its name for ``attn_implementation``."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
