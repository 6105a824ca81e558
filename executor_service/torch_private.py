"""The private parts of torch that Baton's CPU backends call, and the only place that names them.

- ``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``: a linear layer over a
  weight reordered once into oneDNN's blocked layout (``packed_linear.py`` says why);
- ``torch.ops.mkldnn._is_mkldnn_bf16_supported``: whether oneDNN runs bf16 natively here;
- ``at::native::cpublas::brgemm``, ``brgemm_release`` and ``could_pack``, C++ functions of
  ``libtorch_cpu.so`` resolved by their mangled names through ctypes: oneDNN's BRGeMM
  micro-kernel (``kernels/small_gemm.py`` says why).

None of these is a public API: a torch release may drop them, rename them or change what they
compute. So nothing here is used unchecked: each resolves to ``None``/``False`` where it is
missing, and ``guarded_ops.GuardedOps.probe`` runs each one on a small input at start, against the
public op it stands in for, before a backend may use it. The mangled names encode the parameter
types, so a changed signature no longer resolves rather than being called wrongly. pyproject.toml
pins torch to the minor release these were tested on.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

_BRGEMM_BF16 = "_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb"
_BRGEMM_RELEASE = "_ZN2at6native7cpublas14brgemm_releaseEb"
_COULD_PACK = "_ZN2at6native7cpublas10could_packEN3c1010ScalarTypeE"
_BFLOAT16 = 15  # c10::ScalarType::BFloat16


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN and both ops of the prepacked linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    return all(hasattr(torch.ops.mkldnn, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))


def reorder_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered for oneDNN's linear (a new tensor, as large as the weight)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``packed = reorder_linear_weight(weight)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_native_bf16() -> bool:
    """Whether oneDNN computes bf16 natively here (AVX-512 BF16, AMX) rather than emulating it."""
    query = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(query()) if query is not None else False


@cache
def brgemm_bf16() -> tuple[int, int] | None:
    """Addresses of torch's bf16 ``brgemm`` and ``brgemm_release``, or None where they cannot serve."""
    library_path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not library_path.exists():
        return None
    try:
        library = ctypes.CDLL(str(library_path))
        brgemm, release, could_pack = (getattr(library, name) for name in (_BRGEMM_BF16, _BRGEMM_RELEASE, _COULD_PACK))
    except (OSError, AttributeError):
        return None
    could_pack.restype, could_pack.argtypes = ctypes.c_bool, [ctypes.c_int8]
    if not could_pack(_BFLOAT16):
        return None  # no bf16 micro-kernel here (no AVX512-BF16 or AMX): its fallback is a slow loop
    return ctypes.cast(brgemm, ctypes.c_void_p).value or 0, ctypes.cast(release, ctypes.c_void_p).value or 0
