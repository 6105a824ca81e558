"""A lean forward pass for Llama-architecture models, over the model's own modules and weights.

Why: transformers' forward spends a large part of a small model's step outside the arithmetic:
module dispatch, keyword plumbing, mask bookkeeping, and three projections (q, k, v) plus two
(gate, up) that each read the same input. This forward runs the same computation with the
projections that share an input fused into one matmul, and the final norm applied only to the rows
that are sampled. Everything else (embedding, rotary tables, RMSNorm, attention through
``paged_attention``) calls the model's own modules, so the numbers are those of the model;
greedy outputs are tested against ``model.generate``. On CPU (float32 or bfloat16) the elementwise work
between the matmuls (residual add + RMSNorm, RoPE with the K/V write, SiLU-and-multiply) runs as
native calls instead (``kernels.layer_ops``), with the model's own norm weights and rotary tables.

For ``LlamaForCausalLM`` and ``MistralForCausalLM`` (same layout) with SiLU MLPs, Mistral's sliding
window included (every layer attends within ``config.sliding_window``, as ``MistralAttention``
does): the backends that run it (``backends/cpu_native.py``, ``backends/cuda.py``) declare that
support, and the registry gives any other model a backend with transformers' forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.kernels import layer_ops
from executor_service.kernels.small_gemm import SmallGemm
from executor_service.packed_linear import PackedLinear
from executor_service.paged_attention import AttentionBatch, paged_attention
from executor_service.torch_private import onednn_linear, reorder_linear_weight


class FusedLinear:
    """One matmul for linear layers that read the same input; returns each layer's slice of the output.

    No weight is held twice: where the layers were packed for oneDNN (``PackedLinear``, which a
    backend makes only where the private ops passed their self-test) the fused weight is packed
    too and the layers' own packed copies are dropped; elsewhere the layers' weights become views
    of the fused one. With ``small_gemm`` (``GuardedOps.small_gemm``) a small bf16 weight also gets
    the micro-kernel's copy (``SmallGemm``, at most 512 KB), which serves its decode rows.
    """

    def __init__(self, linears: Sequence[Any], small_gemm: bool = False) -> None:  # nn.Linear or PackedLinear
        weight = torch.cat([layer.weight.detach() for layer in linears])
        self.sizes = [int(layer.weight.shape[0]) for layer in linears]
        biases = [layer.bias for layer in linears]
        self.bias = None
        if any(b is not None for b in biases):
            pairs = zip(biases, self.sizes, strict=True)
            self.bias = torch.cat([b.detach() if b is not None else weight.new_zeros(n) for b, n in pairs])
        self.packed = all(isinstance(layer, PackedLinear) and layer.packed is not None for layer in linears)
        self.small = SmallGemm.for_weight(weight, self.bias) if self.packed and small_gemm else None
        if self.packed:
            self.weight = reorder_linear_weight(weight)
            for layer in linears:
                if isinstance(layer, PackedLinear):
                    layer.release_packed()
        else:
            self.weight = weight
            for layer, part in zip(linears, weight.split(self.sizes), strict=True):
                layer.weight = nn.Parameter(part, requires_grad=False)

    def joined(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' outputs side by side, [..., sum of their sizes]."""
        if self.small is not None and self.small.serves(x):
            return self.small(x)
        if self.packed:
            return onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.joined(x).split(self.sizes, dim=-1)


@dataclass(frozen=True)
class LayerParts:
    attention: nn.Module  # the model's attention module (paged_attention reads its layer_idx)
    input_norm: nn.Module
    qkv: FusedLinear
    o_proj: nn.Module
    post_norm: nn.Module
    gate_up: FusedLinear
    down_proj: nn.Module
    scaling: float
    index: int  # the layer's place in the KV pool
    input_eps: float  # the two norms' epsilons (LlamaRMSNorm's and MistralRMSNorm's ``variance_epsilon``)
    post_eps: float


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FastLlamaForward:
    """``logits = forward(input_ids [N], positions [N], sample_rows [S], batch)``, float32 [S, vocab] or model dtype."""

    def __init__(self, model: Any, small_gemm: bool = False) -> None:  # LlamaForCausalLM or MistralForCausalLM
        inner, config = model.model, model.config
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.lm_head = model.lm_head
        self.heads: int = config.num_attention_heads
        self.kv_heads: int = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        # Mistral windows every layer alike (Llama's config has no window).
        self.window: int | None = getattr(config, "sliding_window", None) or None
        self.layers = [
            LayerParts(
                attention=layer.self_attn,
                input_norm=layer.input_layernorm,
                qkv=FusedLinear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], small_gemm),
                o_proj=layer.self_attn.o_proj,
                post_norm=layer.post_attention_layernorm,
                gate_up=FusedLinear([layer.mlp.gate_proj, layer.mlp.up_proj], small_gemm),
                down_proj=layer.mlp.down_proj,
                scaling=float(layer.self_attn.scaling),
                index=int(layer.self_attn.layer_idx),
                input_eps=float(layer.input_layernorm.variance_epsilon),
                post_eps=float(layer.post_attention_layernorm.variance_epsilon),
            )
            for layer in inner.layers[: config.num_hidden_layers]
        ]
        # On CPU (float32, bfloat16), norms, RoPE with the KV write, and SiLU run as one native call each.
        self.native_layer_ops = layer_ops.available(self.lm_head.weight.device, self.lm_head.weight.dtype)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)  # [N, hidden]
        cos, sin = self.rotary(hidden, positions[None])  # [1, N, head_dim] each
        layers = self._native_layers if self.native_layer_ops else self._torch_layers
        hidden = layers(hidden, cos[0], sin[0], batch)
        # RMSNorm works row by row, so norming only the sampled rows gives the same values.
        return self.lm_head(self.norm(hidden[sample_rows]))

    def _attention(
        self, layer: LayerParts, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, **kv: bool
    ) -> torch.Tensor:
        """paged_attention on [N, heads, d] views, which it takes in transformers' [1, heads, N, d] layout."""
        out, _ = paged_attention(
            layer.attention,
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            None,
            scaling=layer.scaling,
            sliding_window=self.window,
            baton_batch=batch,
            **kv,
        )
        return out.view(q.shape[0], self.heads * self.head_dim)

    def _torch_layers(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        count = hidden.shape[0]
        cos, sin = cos[:, None], sin[:, None]  # [N, 1, head_dim]: broadcast over heads
        for layer in self.layers:
            residual = hidden
            q, k, v = layer.qkv(layer.input_norm(hidden))
            q = q.view(count, self.heads, self.head_dim)
            k = k.view(count, self.kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            v = v.view(count, self.kv_heads, self.head_dim)
            hidden = residual + layer.o_proj(self._attention(layer, q, k, v, batch))
            residual = hidden
            gate, up = layer.gate_up(layer.post_norm(hidden))
            hidden = residual + layer.down_proj(F.silu(gate) * up)
        return hidden

    def _native_layers(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """The same layers with the elementwise work in native calls; ``hidden`` is updated in place."""
        count, delta = hidden.shape[0], None
        q_end = self.heads * self.head_dim
        k_end = q_end + self.kv_heads * self.head_dim
        for layer in self.layers:
            input_weight = cast(torch.Tensor, layer.input_norm.weight)
            qkv = layer.qkv.joined(layer_ops.add_rms_norm(hidden, delta, input_weight, layer.input_eps))
            keys, values = batch.pool.keys[layer.index], batch.pool.values[layer.index]
            layer_ops.rope_store(qkv, cos, sin, self.heads, self.kv_heads, keys, values, batch.slot_mapping)
            q = qkv[:, :q_end].view(count, self.heads, self.head_dim)
            k = qkv[:, q_end:k_end].view(count, self.kv_heads, self.head_dim)
            v = qkv[:, k_end:].view(count, self.kv_heads, self.head_dim)
            attended = layer.o_proj(self._attention(layer, q, k, v, batch, baton_kv_written=True))
            post_weight = cast(torch.Tensor, layer.post_norm.weight)
            normed = layer_ops.add_rms_norm(hidden, attended, post_weight, layer.post_eps)
            delta = layer.down_proj(layer_ops.silu_mul(layer.gate_up.joined(normed)))
        return hidden + delta if delta is not None else hidden
