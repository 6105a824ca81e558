"""Attention over the paged KV cache, plugged into transformers through ``AttentionInterface``.

Why our own kernel: transformers' continuous-batching paths (``sdpa``, ``paged|eager``) pack
all requests into one sequence under a [total queries x total keys] block-diagonal mask, so
on CPU a step costs O(requests^2). Here each request attends only to its own context:
O(tokens x own context).

The model runs one packed sequence [1, N] per step; the model computes Q/K/V and RoPE as usual
(any HF model using the attention interface works), and this function writes the new K/V into
the pool and attends per request. Step metadata arrives through the ``baton_batch`` kwarg,
which transformers passes down to attention untouched.

Five ways to read a request's context; the model runner builds each step's batch for the way its
backend declares (``backends.base.DecodeRead``):
- every single-token decode of the step in one call of the native kernel
  (``executor_service.kernels``, CPU), which reads each context block by block through its block table;
- a view of the pool, when the request's blocks are consecutive: nothing is copied. On CPU without
  the native kernel every decode with a contiguous context takes this path, one small SDPA call
  each, because copying contexts costs more there than the attention itself;
- its blocks gathered (``index_select`` of whole blocks) into a padded batch, for all decodes
  at once: one SDPA call, the right trade where kernel launches are dear (CUDA) or the blocks
  are scattered;
- every decode of a full-attention layer in one call of a kernel that reads each context in place
  through its block table (``paged_decode.py``: torch's FlashAttention on CUDA, where the block size
  and dtype allow it);
- a fresh prefill attends to its own new K/V directly; a prompt chunk after cached tokens gathers
  its context's blocks and attends under a causal mask, one SDPA call each.
Where the native decode kernel reads the pool, no layer is windowed and the CPU has AVX-512 or AVX2
and FMA for a float32 pool (AVX512-BF16 for a bfloat16 one), every prompt chunk of the step is
instead one call of the native prefill kernel (``kernels/prefill_attention.c``), which reads each
chunk's keys in place through its block table: no gathered copy, no mask, sixteen queries against
a key at once.
Grouped-query attention never expands K/V: a decode's query heads are folded into the query
length (``[kv_heads, group, d]``), which is the same computation.

A layer with a sliding window (the ``sliding_window`` transformers hands it) reads only the keys
its window covers (``sliding_window.py``): the model runner builds the step's reads twice where the
model has both kinds of layer, once for full attention and once for the window (``ContextReads``),
and once where it has one kind. Windowed reads start at the window, never before it, so the blocks
a window has passed may be released: nothing reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from executor_service.kernels.decode_attention import PagedDecodes, decode_attention
from executor_service.kernels.prefill_attention import PagedPrefills, prefill_attention
from executor_service.kv_cache import KVPool
from executor_service.model_support import UnsupportedModel
from executor_service.paged_decode import PagedGroup, attend_paged

ATTENTION_NAME = "baton_paged"


@dataclass(frozen=True)
class ContextBlocks:
    """Keys that lie in whole blocks of the pool, not one after another: ``blocks`` (int64, in order),
    read from token ``offset`` of the first. Gathered a block at a time, a copy of ``block_size``
    rows per index, where gathering by slot indexes every row on its own."""

    blocks: torch.Tensor
    offset: int
    block_size: int

    def gather(self, pool: torch.Tensor, length: int) -> torch.Tensor:
        """``length`` rows of ``pool`` [slots, ...] from the first block's ``offset`` on, in order."""
        blocks = pool.view(-1, self.block_size, *pool.shape[1:]).index_select(0, self.blocks)
        return blocks.flatten(0, 1)[self.offset : self.offset + length]


@dataclass(frozen=True)
class PrefillSegment:
    """One request's chunk of query tokens within the packed step, and the keys it reads."""

    start: int  # first query row in the packed sequence
    end: int  # one past the last query row
    # Where the keys the chunk reads are (its cached context, from the first key any of its queries
    # reads, then the chunk): None for a fresh prefill (the chunk is the whole context: it attends to
    # its own K/V directly), a first slot when those keys are contiguous in the pool, or else their blocks.
    context: int | ContextBlocks | None
    context_len: int  # keys read
    # Boolean [chunk, keys] mask, True where attention is allowed. None: plain causal attention over
    # the chunk's own K/V (a fresh prefill no window cuts into).
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeView:
    """A single-token decode whose keys are contiguous in the pool."""

    row: int  # query row in the packed sequence
    first_slot: int  # the slot of the first key it reads
    length: int  # keys it reads, the new token's included


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token decodes attended in one padded batch over their gathered blocks."""

    rows: torch.Tensor  # [D] query rows in the packed sequence
    block_tables: torch.Tensor  # [D, W] each decode's block ids from the first block it reads, padded
    mask: torch.Tensor  # [D, 1, 1, W * block_size] True for the keys it reads


@dataclass(frozen=True)
class ContextReads:
    """How the layers of one kind (full causal attention, or one sliding window) read each request's keys."""

    window: int | None  # the sliding window these reads are cut to; None: every earlier token
    prefills: tuple[PrefillSegment, ...] = ()
    decode_views: tuple[DecodeView, ...] = ()
    decodes: DecodeGroup | None = None
    # The kernel cuts each context to ``window`` itself, so both kinds share one ``PagedDecodes``.
    native_decodes: PagedDecodes | None = None
    # Prompt chunks read in place by the native prefill kernel (full attention only), instead of ``prefills``.
    native_prefills: PagedPrefills | None = None
    paged_decodes: PagedGroup | None = None  # full attention only (DecodeRead.PAGED)


@dataclass(frozen=True)
class AttentionBatch:
    """What attention needs to know about one packed step."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [N] where each query token's K/V is written
    # The reads of layers with full attention; None when every layer is windowed (the blocks its
    # window passed may be released, so there is no whole context to read).
    full: ContextReads | None
    windowed: ContextReads | None = None  # the reads of windowed layers; None when the model has none

    def reads(self, window: int | None) -> ContextReads:
        """The reads built for a layer with this ``sliding_window`` (None: full attention)."""
        reads = self.full if window is None else self.windowed
        if reads is None or reads.window != window:
            built = [f"window {r.window}" if r.window else "full attention" for r in (self.full, self.windowed) if r]
            asked = f"a sliding window of {window}" if window else "full attention"
            raise UnsupportedModel(f"a layer asks for {asked}; this step was built for {' and '.join(built)}")
        return reads


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
    # Causal softmax attention, tanh soft-capped where the model asks (Gemma 2), with learned sinks
    # where it has them (gpt-oss passes them as ``s_aux``). A path that cannot compute what the model
    # asks raises rather than compute less (the registry gives such models a backend whose every path
    # can; this catches any that slip past it).
    softcap: float | None = kwargs.get("softcap")
    sinks: torch.Tensor | None = kwargs.get("s_aux")
    batch: AttentionBatch | None = kwargs.get("baton_batch")
    if batch is None:  # its layers drop the keyword arguments the model's forward was given
        raise UnsupportedModel("the model's layers do not pass the step's attention arguments on to the attention")
    reads = batch.reads(kwargs.get("sliding_window") or None)
    layer = int(getattr(module, "layer_idx", 0))
    keys, values = batch.pool.keys[layer], batch.pool.values[layer]
    if not kwargs.get("baton_kv_written", False):  # the lean forward's native RoPE call writes them itself
        keys[batch.slot_mapping] = key[0].transpose(0, 1)  # [N, Hkv, d]
        values[batch.slot_mapping] = value[0].transpose(0, 1)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [N, H, d]
    for seg in reads.prefills:
        out[seg.start : seg.end] = _prefill(query, key, value, keys, values, seg, scaling, softcap, sinks)
    if (reads.native_prefills is not None or reads.native_decodes is not None or reads.paged_decodes is not None) and (
        sinks is not None
    ):
        raise UnsupportedModel("the native and in-place paged attention kernels do not compute attention sinks")
    if reads.native_prefills is not None:
        if softcap is not None or reads.window is not None:
            raise UnsupportedModel("the native prefill kernel serves full attention without soft-capping only")
        scale = scaling if scaling is not None else query.shape[3] ** -0.5
        prefill_attention(query, keys, values, reads.native_prefills, batch.pool.block_size, scale, out)
    if reads.native_decodes is not None:
        if softcap is not None:
            raise UnsupportedModel("the native decode kernel does not soft-cap attention logits")
        scale = scaling if scaling is not None else query.shape[3] ** -0.5
        block_size = batch.pool.block_size
        decode_attention(query, keys, values, reads.native_decodes, block_size, scale, out, reads.window or 0)
    if reads.decode_views:
        _decode_views(query, keys, values, reads.decode_views, scaling, softcap, sinks, out)
    if reads.decodes is not None:
        _decode_group(query, keys, values, reads.decodes, batch.pool.block_size, scaling, softcap, sinks, out)
    if reads.paged_decodes is not None:
        if softcap is not None or reads.window is not None:
            raise UnsupportedModel("in-place paged decode reads serve full attention without soft-capping only")
        group = reads.paged_decodes
        scale = scaling if scaling is not None else query.shape[3] ** -0.5
        q = query[0, :, group.rows].transpose(0, 1).contiguous()  # [D, H, d]
        out[group.rows] = attend_paged(q, keys, values, group, batch.pool.block_size, scale)
    return out.unsqueeze(0), None


def _prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seg: PrefillSegment,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The chunk's output rows, [chunk, H, d]."""
    q = query[:, :, seg.start : seg.end]
    gqa = query.shape[1] != key.shape[1]
    head_sinks = None if sinks is None else sinks.view(-1, 1, 1)  # one per query head: [H, 1, 1]
    if seg.context is None:
        k, v = key[:, :, seg.start : seg.end], value[:, :, seg.start : seg.end]
        o = attend(q, k, v, scaling, softcap, seg.mask, seg.mask is None, gqa, head_sinks)
        return o[0].transpose(0, 1)
    if isinstance(seg.context, int):
        ctx = slice(seg.context, seg.context + seg.context_len)
        k, v = keys[ctx], values[ctx]
    else:
        k, v = seg.context.gather(keys, seg.context_len), seg.context.gather(values, seg.context_len)
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    o = attend(q, k, v, scaling, softcap, seg.mask, enable_gqa=gqa, sinks=head_sinks)
    return o[0].transpose(0, 1)


def _decode_views(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    views: tuple[DecodeView, ...],
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[3]
    rows = query[0].transpose(0, 1)  # [N, H, d]
    grouped_sinks = _grouped(sinks, kv_heads)
    for view in views:
        q = rows[view.row].view(1, kv_heads, heads // kv_heads, dim)
        ctx = slice(view.first_slot, view.first_slot + view.length)
        k = keys[ctx].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, d], a view
        v = values[ctx].transpose(0, 1).unsqueeze(0)
        out[view.row] = attend(q, k, v, scaling, softcap, sinks=grouped_sinks).view(heads, dim)


def _decode_group(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: DecodeGroup,
    block_size: int,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[3]
    count, width = group.block_tables.shape
    tables = group.block_tables.flatten()
    shape = (count, width * block_size, kv_heads, dim)
    # Whole blocks are copied (contiguous runs of block_size * Hkv * d), not token by token.
    k = keys.view(-1, block_size, kv_heads, dim).index_select(0, tables).view(shape).transpose(1, 2)
    v = values.view(-1, block_size, kv_heads, dim).index_select(0, tables).view(shape).transpose(1, 2)
    q = query[0, :, group.rows].transpose(0, 1).reshape(count, kv_heads, heads // kv_heads, dim)
    o = attend(q, k, v, scaling, softcap, mask=group.mask, sinks=_grouped(sinks, kv_heads))
    out[group.rows] = o.reshape(count, heads, dim)


def _grouped(sinks: torch.Tensor | None, kv_heads: int) -> torch.Tensor | None:
    """The sinks laid out as a decode's grouped queries are, [Hkv, H / Hkv, 1]: query head h reads
    key head h // (H / Hkv), as transformers' ``repeat_kv`` pairs them."""
    return None if sinks is None else sinks.view(kv_heads, -1, 1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention, SDPA's arguments and result (``mask``: True where a key is seen).

    SDPA has no soft-capping, so a soft-capped model's attention is computed as transformers'
    eager Gemma 2 attention does: scores * scale, then cap * tanh(scores / cap), the mask, a float32
    softmax, and the weighted values. Nor has it sinks: ``sinks`` (one logit per query row's head,
    shaped to broadcast over the scores' heads and rows) are computed as gpt-oss's eager attention
    does, a column every query attends to that takes its share of the softmax and adds no value.
    """
    if sinks is not None:
        if softcap is not None:  # no model has both; computing one of them would be wrong
            raise UnsupportedModel("attention with both sinks and soft-capped logits is not computed")
        return _attend_with_sinks(q, k, v, scaling, mask, is_causal, enable_gqa, sinks)
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa
        )
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        length = scores.shape[-1]
        mask = torch.ones(scores.shape[-2], length, dtype=torch.bool, device=q.device).tril(length - scores.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def _attend_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float | None,
    mask: torch.Tensor | None,
    is_causal: bool,
    enable_gqa: bool,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``attend`` with a sink logit per head, in transformers' gpt-oss order: scores * scale, the
    mask, the sinks as one more column, the row's maximum subtracted, a softmax in the scores'
    dtype, and the sinks' column dropped before the values are weighted."""
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if is_causal:
        length = scores.shape[-1]
        mask = torch.ones(scores.shape[-2], length, dtype=torch.bool, device=q.device).tril(length - scores.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    weights = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(weights, v)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # Masks are built per request inside paged_attention; the model must not build a global one.
    return None


def register() -> str:
    """Register the attention function (idempotent) and return its name for ``attn_implementation``."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
