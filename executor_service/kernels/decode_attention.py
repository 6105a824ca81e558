"""Torch-facing side of the native paged decode-attention kernel (``decode_attention.c``)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from executor_service.kernels import concatenated_tables, decode_attention_library

SUPPORTED_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class PagedDecodes:
    """Every single-token decode of a step, with the block tables to read their contexts through.

    Built once per step and used by every layer. All int64 tensors on the CPU. The kernel reads
    decode i's table from ``tables[table_offsets[i]]`` on, as many blocks as its length needs, so
    the tables may lie one after another (``build``) or be rows of a fixed-width matrix (the
    persistent decode rows, ``decode_step.py``, which pass the rows' starts only).
    """

    rows: torch.Tensor  # [D] query row of each decode in the packed step
    lengths: torch.Tensor  # [D] context length, the new token included
    table_offsets: torch.Tensor  # [D] (or [D + 1]) where each block table starts in ``tables``
    tables: torch.Tensor  # the block tables

    @classmethod
    def build(cls, rows: list[int], lengths: list[int], tables: list[list[int]]) -> PagedDecodes:
        offsets, flat = concatenated_tables(tables)
        as_tensor = torch.tensor
        return cls(as_tensor(rows), as_tensor(lengths), as_tensor(offsets), as_tensor(flat))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel can serve this device and dtype (building it on first ask)."""
    return device.type == "cpu" and dtype in SUPPORTED_DTYPES and decode_attention_library() is not None


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    decodes: PagedDecodes,
    block_size: int,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    share: bool = True,
) -> None:
    """Write ``out[row]`` for every decode.

    query [1, H, N, d] (any strides, head_dim contiguous), one layer's keys/values [slots, Hkv, d], out [N, H, d].
    ``window`` > 0: each decode reads only the last ``window`` tokens of its context (a sliding window);
    the blocks before them are never read, so their table entries may be anything.
    ``share``: decodes whose tables begin with the same blocks (one cached prompt prefix) read those
    blocks once together; False reads each decode's context alone. The outputs are bit for bit the same.
    """
    library = decode_attention_library()
    if library is None:
        raise RuntimeError("the native decode-attention kernel is not available")
    heads, dim, kv_heads = query.shape[1], query.shape[3], keys.shape[1]
    if query.stride(3) != 1:
        query = query.contiguous()
    for name, tensor in (("keys", keys), ("values", values), ("out", out)):
        if not tensor.is_contiguous() or tensor.dtype != query.dtype or tensor.device.type != "cpu":
            raise ValueError(f"decode_attention needs {name} contiguous on the CPU in the query's dtype")
    status = library.baton_decode_attention(
        query.data_ptr(), query.stride(2), query.stride(1),
        keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
        out.data_ptr(), out.stride(0), out.stride(1),
        decodes.rows.data_ptr(), decodes.lengths.data_ptr(),
        decodes.table_offsets.data_ptr(), decodes.tables.data_ptr(), decodes.rows.numel(),
        block_size, window, heads, kv_heads, dim,
        ctypes.c_float(scale), SUPPORTED_DTYPES[query.dtype], torch.get_num_threads(), int(share),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("decode_attention could not allocate its score buffers")
