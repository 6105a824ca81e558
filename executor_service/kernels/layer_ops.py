"""Torch-facing side of the native layer ops (``layer_ops.c``): float32 or bfloat16 CPU tensors
(every tensor of one call in the same dtype).

Large calls split their rows between the calling thread's torch threads (``torch.get_num_threads``),
as torch's own ops would; every row is computed the same way whatever the split.

Each function checks what the C code assumes (dtype, device, contiguous rows) and raises ValueError
otherwise, so a wrong call fails loudly instead of reading the wrong memory.
"""

from __future__ import annotations

import ctypes

import torch

from executor_service.kernels import layer_ops_library

LAYER_DTYPES = (torch.float32, torch.bfloat16)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the norm, RoPE and SiLU ops serve this device and dtype (building them on first ask)."""
    return device.type == "cpu" and dtype in LAYER_DTYPES and layer_ops_library() is not None


def _suffix(dtype: torch.dtype) -> str:
    """The C function's suffix for this dtype."""
    return "_bf16" if dtype == torch.bfloat16 else ""


def _library() -> ctypes.CDLL:
    library = layer_ops_library()
    if library is None:
        raise RuntimeError("the native layer ops are not available")
    return library


def _check(name: str, tensor: torch.Tensor, row_stride_ok: bool = False, dtype: torch.dtype = torch.float32) -> None:
    if tensor.dtype != dtype or tensor.device.type != "cpu":
        raise ValueError(f"{name} must be {str(dtype)[6:]} on the CPU, got {tensor.dtype} on {tensor.device}")
    contiguous = tensor.stride(-1) == 1 if row_stride_ok else tensor.is_contiguous()
    if not contiguous:
        raise ValueError(f"{name} must be contiguous")


def _layer_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The call's dtype, taken from its main tensor: float32 or bfloat16."""
    if tensor.dtype not in LAYER_DTYPES:
        raise ValueError(f"the layer ops take float32 or bfloat16 tensors, got {tensor.dtype}")
    return tensor.dtype


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``hidden += delta`` in place (when given), then return RMSNorm(hidden) * weight. hidden [N, d]."""
    rows, dim = hidden.shape
    dtype = _layer_dtype(hidden)
    _check("hidden", hidden, dtype=dtype)
    _check("weight", weight, dtype=dtype)
    if delta is not None:
        _check("delta", delta, dtype=dtype)
        if delta.shape != hidden.shape:
            raise ValueError(f"delta {tuple(delta.shape)} does not match hidden {tuple(hidden.shape)}")
    out = torch.empty_like(hidden)
    delta_ptr = delta.data_ptr() if delta is not None else None
    getattr(_library(), "baton_add_rms_norm" + _suffix(dtype))(
        hidden.data_ptr(), delta_ptr, weight.data_ptr(), out.data_ptr(), rows, dim, eps, torch.get_num_threads()
    )
    return out


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """RoPE on the query and key heads of ``qkv`` [N, (heads + 2 kv_heads) * d] in place; K and V to the pool.

    cos/sin [N, d]; keys/values one layer's pool [slots, kv_heads, d]; slots [N] int64.
    """
    rows, width = qkv.shape
    dim = cos.shape[-1]
    if width != (heads + 2 * kv_heads) * dim or cos.shape != (rows, dim) or sin.shape != cos.shape:
        raise ValueError(
            f"qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}: shapes do not match {heads}+2x{kv_heads} heads"
        )
    dtype = _layer_dtype(qkv)
    for name, tensor in (("cos", cos), ("sin", sin), ("keys", keys), ("values", values)):
        _check(name, tensor, dtype=dtype)
    _check("qkv", qkv, row_stride_ok=True, dtype=dtype)
    if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.numel() != rows:
        raise ValueError("slots must be a contiguous int64 tensor with one slot per row")
    if keys.shape[1:] != (kv_heads, dim) or values.shape != keys.shape:
        raise ValueError(f"pool {tuple(keys.shape)} is not [slots, {kv_heads}, {dim}]")
    getattr(_library(), "baton_rope_store" + _suffix(dtype))(
        qkv.data_ptr(), rows, qkv.stride(0), cos.data_ptr(), sin.data_ptr(), heads, kv_heads, dim,
        keys.data_ptr(), values.data_ptr(), slots.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``gate_up`` [N, 2 * inter] (gate first), as [N, inter]."""
    dtype = _layer_dtype(gate_up)
    _check("gate_up", gate_up, dtype=dtype)
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    silu_mul_rows = getattr(_library(), "baton_silu_mul" + _suffix(dtype))
    silu_mul_rows(gate_up.data_ptr(), rows, width // 2, out.data_ptr(), torch.get_num_threads())
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for float32 or bfloat16 [rows, cols] on the CPU (rows may be strided)."""
    dtype = _layer_dtype(logits)
    _check("logits", logits, row_stride_ok=True, dtype=dtype)
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.long)
    if rows and cols:
        argmax = getattr(_library(), "baton_argmax_rows" + _suffix(dtype))
        argmax(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr())
    return out
