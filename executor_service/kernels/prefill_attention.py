"""Torch-facing side of the native paged prefill-attention kernel (``prefill_attention.c``)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from executor_service.kernels import concatenated_tables, prefill_attention_library

SUPPORTED_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class PagedPrefills:
    """Every prompt chunk of a step, with the block tables to read their keys through.

    Built once per step and used by every layer; all int64 tensors on the CPU. Chunk i's queries are
    rows ``rows[i] .. rows[i] + counts[i]`` of the packed step, at positions ``starts[i]`` onwards of
    its sequence, and attend to keys ``0 .. position`` read through ``tables[table_offsets[i]:]``.
    """

    rows: torch.Tensor  # [P] first query row of each chunk in the packed step
    counts: torch.Tensor  # [P] query rows of each chunk
    starts: torch.Tensor  # [P] the position of each chunk's first query in its sequence
    table_offsets: torch.Tensor  # [P + 1] where each block table starts in ``tables``
    tables: torch.Tensor  # the block tables, one after another

    @classmethod
    def build(cls, rows: list[int], counts: list[int], starts: list[int], tables: list[list[int]]) -> PagedPrefills:
        offsets, flat = concatenated_tables(tables)
        as_tensor = torch.tensor
        return cls(as_tensor(rows), as_tensor(counts), as_tensor(starts), as_tensor(offsets), as_tensor(flat))


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel can serve this device, dtype and head size (building it on first ask): a
    float32 pool on a CPU with AVX-512 or with AVX2 and FMA, a bfloat16 one with AVX512-BF16; head_dim
    a multiple of 64."""
    if device.type != "cpu" or dtype not in SUPPORTED_DTYPES:
        return False
    library = prefill_attention_library()
    return library is not None and bool(library.baton_prefill_attention_supported(head_dim, SUPPORTED_DTYPES[dtype]))


def prefill_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefills: PagedPrefills,
    block_size: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Write ``out`` rows of every chunk: causal attention over its sequence's keys in the pool.

    query [1, H, N, d] (any strides, head_dim contiguous), one layer's keys/values [slots, Hkv, d]
    holding every key the chunks read (their own included), out [N, H, d]; all float32 or all bfloat16.
    """
    library = prefill_attention_library()
    if library is None:
        raise RuntimeError("the native prefill-attention kernel is not available")
    heads, dim, kv_heads = query.shape[1], query.shape[3], keys.shape[1]
    if query.stride(3) != 1:
        query = query.contiguous()
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"prefill_attention serves float32 and bfloat16, not {query.dtype}")
    for name, tensor in (("keys", keys), ("values", values), ("out", out)):
        if not tensor.is_contiguous() or tensor.dtype != query.dtype or tensor.device.type != "cpu":
            raise ValueError(f"prefill_attention needs {name} contiguous on the CPU in the query's dtype")
    status = library.baton_prefill_attention(
        query.data_ptr(), query.stride(2), query.stride(1),
        keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
        out.data_ptr(), out.stride(0), out.stride(1),
        prefills.rows.data_ptr(), prefills.counts.data_ptr(), prefills.starts.data_ptr(),
        prefills.table_offsets.data_ptr(), prefills.tables.data_ptr(), prefills.rows.numel(),
        block_size, heads, kv_heads, dim, ctypes.c_float(scale), SUPPORTED_DTYPES[query.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise ValueError(
            f"prefill_attention cannot serve {query.dtype} with head_dim {dim} and {heads} heads over {kv_heads} here"
        )
    if status != 0:
        raise MemoryError("prefill_attention could not allocate its buffers")
