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
import torch.nn.functional as F

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


def onednn_rows(rows: int) -> int:
    """How many rows oneDNN's linear computes for ``rows``: up to 16 as they are; more rounded up to a
    multiple of 16, or of an eighth of the power of two above them, whichever is larger.

    Why: oneDNN compiles a kernel for every row count it meets (and keeps 1,024 in its cache). A
    step's rows are its decodes plus its prefill chunk, nearly always a count not met before, and
    compiling costs milliseconds (6.7 ms for a 1,500-row bf16 shape with AMX, more than a tiny model's
    whole decode step). Rounded, about 60 counts cover up to 4,096 rows, each compiled once, and the
    padding rows past 128 cost less than an eighth of the real ones.
    """
    if rows <= 16:
        return rows
    step = max(16, 1 << max(0, (rows - 1).bit_length() - 4))
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``packed = reorder_linear_weight(weight)``, its rows padded
    to ``onednn_rows`` (zeros) and the padding's outputs dropped."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    padded = onednn_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    wide = F.pad(x.reshape(rows, features), (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(wide, packed, bias, "none", [], "")[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


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
