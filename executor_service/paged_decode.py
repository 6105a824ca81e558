"""Single-token decodes that read their context in place, through each one's block table.

On CUDA this is torch's own FlashAttention (``torch.nn.attention.varlen.varlen_attn`` with a
``block_table`` and per-row lengths, ``seqused_k``): the kernel walks each row's table and reads the
pool's blocks where they lie, so nothing is gathered, and it has fixed shapes for a fixed batch and
table width, so a CUDA graph captures it. It is a public torch API, but torch's build of the kernel
serves a paged cache only when a block holds a multiple of 256 tokens, in float16 or bfloat16, on an
Ampere or newer GPU. ``unavailable`` says which of those a configuration misses; the CUDA backend
uses the kernel only where nothing is missing and its self-test at start (``self_test``) agrees with
the gathered reads of ``paged_attention``, and gathers otherwise.

Everywhere else ``attend_paged`` computes the same reads from the same ``PagedGroup`` by
gathering the blocks (``gathered_reference``): the oracle of the self-test, and what lets the tests
run the paged read path's step building, on the CPU, against ``model.generate``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# torch's FlashAttention reads a paged cache only in blocks of a multiple of this many tokens.
FLASH_PAGE_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256

# The self-test's tolerance, of the largest output magnitude: two accumulation orders of fp16/bf16
# products in float32, then one rounding to the storage dtype (bf16 keeps 8 bits).
SELF_TEST_TOLERANCE = 2.0**-6


def unavailable(device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int) -> str | None:
    """Why the in-place kernel cannot serve this configuration; None when it can (pending its self-test)."""
    if dtype not in FLASH_DTYPES:
        return f"need float16 or bfloat16 (the model runs in {str(dtype).removeprefix('torch.')})"
    if block_size % FLASH_PAGE_MULTIPLE:
        return f"need executor.block_size to be a multiple of {FLASH_PAGE_MULTIPLE} (it is {block_size})"
    if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return f"need a head size that is a multiple of 8, at most {FLASH_MAX_HEAD_DIM} (it is {head_dim})"
    if device.type != "cuda":
        return f"need a CUDA device (the executor runs on {device.type})"
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return "need torch.nn.attention.varlen, which this torch lacks"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "need an Ampere or newer GPU"
    return None


@dataclass(frozen=True)
class PagedGroup:
    """Single-token decodes read in place through their block tables (``attend_paged``), as every
    layer of a step reads them: built once a step, on the device, so a graph captures it."""

    rows: torch.Tensor  # [D] query rows in the packed sequence
    block_tables: torch.Tensor  # [D, W] int32, each decode's blocks from its first, padded with the scratch block
    lengths: torch.Tensor  # [D] int32, the keys each reads (its new token's included)
    # [D + 1] int32 each: one query per row, and where each row's keys would start packed. The kernel
    # takes each row's length from ``lengths`` and its blocks from its table, but its varlen entry
    # point wants these too.
    query_offsets: torch.Tensor
    key_offsets: torch.Tensor

    @classmethod
    def of(cls, rows: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor) -> PagedGroup:
        """The group of ``rows``, whose tables and lengths are cast to int32 (what the kernel reads)."""
        lengths = lengths.to(torch.int32)
        count = lengths.shape[0]
        key_offsets = torch.zeros(count + 1, dtype=torch.int32, device=lengths.device)
        torch.cumsum(lengths, 0, out=key_offsets[1:])
        query_offsets = torch.arange(count + 1, dtype=torch.int32, device=lengths.device)
        return cls(rows, block_tables.to(torch.int32), lengths, query_offsets, key_offsets)


def attend_paged(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: PagedGroup, block_size: int, scale: float
) -> torch.Tensor:
    """Each decode's attention over its own context: ``q`` [D, H, d], ``keys``/``values`` one layer's
    pool [slots, Hkv, d]; returns [D, H, d]."""
    if not q.is_cuda:
        return gathered_reference(q, keys, values, group, block_size, scale)
    from torch.nn.attention.varlen import varlen_attn

    kv_heads, dim = keys.shape[1], keys.shape[2]
    out = varlen_attn(
        q,
        keys.view(-1, block_size, kv_heads, dim),
        values.view(-1, block_size, kv_heads, dim),
        group.query_offsets,
        group.key_offsets,
        1,
        group.block_tables.shape[1] * block_size,
        scale=scale,
        enable_gqa=q.shape[1] != kv_heads,
        seqused_k=group.lengths,
        block_table=group.block_tables,
    )
    return out[0] if isinstance(out, tuple) else out  # a tuple only where return_aux asks for more


def gathered_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: PagedGroup, block_size: int, scale: float
) -> torch.Tensor:
    """``attend_paged``'s result by gathering every row's blocks and masking past its length (SDPA)."""
    count, width = group.block_tables.shape
    kv_heads, dim = keys.shape[1], keys.shape[2]
    heads = q.shape[1]
    shape = (count, width * block_size, kv_heads, dim)
    flat = group.block_tables.reshape(-1).long()
    k = keys.view(-1, block_size, kv_heads, dim).index_select(0, flat).view(shape).transpose(1, 2)
    v = values.view(-1, block_size, kv_heads, dim).index_select(0, flat).view(shape).transpose(1, 2)
    span = torch.arange(width * block_size, device=q.device)
    mask = (span.unsqueeze(0) < group.lengths.long().unsqueeze(1))[:, None, None]  # [D, 1, 1, W * bs]
    grouped = q.view(count, kv_heads, heads // kv_heads, dim)  # query heads folded into the query length
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return out.reshape(count, heads, dim)


def self_test(
    device: torch.device, dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, head_dim: int
) -> str | None:
    """Run the in-place kernel once on random contexts (lengths within, at and across block edges,
    tables out of order) against ``gathered_reference``; None when they agree, else why not."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    num_blocks, width = 16, 3
    lengths_list = [1, block_size, block_size + 1, 2 * block_size - 1, 3 * block_size]
    count = len(lengths_list)
    try:
        slots = num_blocks * block_size
        keys = torch.randn(slots, kv_heads, head_dim, generator=generator).to(device, dtype)
        values = torch.randn(slots, kv_heads, head_dim, generator=generator).to(device, dtype)
        q = torch.randn(count, heads, head_dim, generator=generator).to(device, dtype)
        order = torch.randperm(num_blocks, generator=generator)[: count * width].view(count, width)
        lengths = torch.tensor(lengths_list, device=device)
        group = PagedGroup.of(torch.arange(count, device=device), order.to(device), lengths)
        scale = head_dim**-0.5
        got = attend_paged(q, keys, values, group, block_size, scale)
        want = gathered_reference(q, keys, values, group, block_size, scale)
    except Exception as exc:  # any failure of the kernel keeps the gathered reads
        return f"{type(exc).__name__}: {exc}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"returned {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    error = (got.float() - want.float()).abs().max().item()
    bound = SELF_TEST_TOLERANCE * max(1.0, want.float().abs().max().item())
    if not error <= bound:  # also catches NaN
        return f"differs from the gathered reads by {error:.3g} (allowed {bound:.3g})"
    return None
