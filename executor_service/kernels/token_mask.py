"""Torch-facing side of the native token-bitmask kernel (``token_mask.c``): a structured output's
bitmask (xgrammar's layout) applied in place to float32 CPU logits rows."""

from __future__ import annotations

import ctypes

import torch

from executor_service.kernels import token_mask_library


def available() -> bool:
    """Whether the kernel serves here (building it on first ask)."""
    return token_mask_library() is not None


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], covered: int) -> None:
    """Set logits[r, t] to -inf for each r in ``rows`` and t < ``covered`` whose bit in
    ``bitmask[r]`` is clear. logits: float32 [R, V] with contiguous rows; bitmask: int32 [B, W]."""
    library = token_mask_library()
    if library is None:
        raise RuntimeError("the native token-bitmask kernel is not available")
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(-1) != 1:
        raise ValueError(f"logits must be float32 CPU rows, got {logits.dtype} on {logits.device}")
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
    if covered > min(logits.shape[1], bitmask.shape[1] * 32):
        raise ValueError(f"{covered} tokens exceed the logits' or the bitmask's width")
    if rows and not (min(rows) >= 0 and max(rows) < min(logits.shape[0], bitmask.shape[0])):
        raise ValueError("a row is outside the logits or the bitmask")
    index = (ctypes.c_int64 * len(rows))(*rows)
    library.baton_apply_token_bitmask(
        logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.shape[1], index, len(rows), covered
    )
