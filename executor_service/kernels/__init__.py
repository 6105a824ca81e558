"""Native CPU kernels, compiled on first use with the system C compiler and loaded through ctypes.

Why plain C and ctypes rather than a torch C++ extension: the kernel needs no torch headers, so it
builds in about a second instead of most of a minute, needs no ninja, and one ctypes call per layer
costs a few microseconds. The shared library is cached under ``BATON_KERNEL_CACHE`` (default
``~/.cache/baton/kernels``), keyed by the source (with the headers beside it), the compiler flags
and the CPU, so concurrent executors on one machine build it once and a different CPU never loads
another's ``-march=native`` build. Without a compiler the executor keeps its torch path (see
``executor_service.paged_attention``).

The short calls (the layer ops and the small GEMM, microseconds each) are loaded with
``ctypes.PyDLL``, which keeps the GIL through the call; ``ctypes.CDLL`` drops it and takes it back.
A drop lets the executor's gRPC thread take the GIL mid-step, and the engine thread then waits for
it to be given back. This removes the drops of about 25 calls a tiny step (torch's own ops may
drop it as well). Measured end to end (benchmarks.md, "Eleventh round"), the effect is within the
noise of the alternated comparison: rounds 3 % shorter with ``PyDLL`` for the small GEMM and 3 %
again for the layer ops, where identical trees differed by 0.5-7 %. It is kept: it holds the GIL
for microseconds at a time, which cannot delay a step. The attention kernels, hundreds of
microseconds a call, keep ``CDLL``, so the gRPC thread can send the last step's report beside it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
LAYER_OPS_SOURCE = Path(__file__).with_name("layer_ops.c")
SMALL_GEMM_SOURCE = Path(__file__).with_name("small_gemm.c")
PREFILL_ATTENTION_SOURCE = Path(__file__).with_name("prefill_attention.c")
TOKEN_MASK_SOURCE = Path(__file__).with_name("token_mask.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# Each product and sum rounded on its own, as torch's separate ops round them (see layer_ops.c).
LAYER_OPS_FLAGS = ("-ffp-contract=off",)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def concatenated_tables(tables: list[list[int]]) -> tuple[list[int], list[int]]:
    """Block tables laid one after another, as the attention kernels read them: (the offset where
    each starts, then one past the last; the tables' blocks in order)."""
    offsets = [0]
    flat: list[int] = []
    for table in tables:
        flat += table
        offsets.append(len(flat))
    return offsets, flat


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def cache_dir() -> Path:
    return Path(os.environ.get("BATON_KERNEL_CACHE") or Path.home() / ".cache" / "baton" / "kernels")


def build(source: Path = SOURCE, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile ``source`` into the cache (once) and return the library's path; raises OSError on failure."""
    flags = (*FLAGS, *extra_flags)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    # The headers beside the source (shared helpers it includes) are part of what is built.
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    text = source.read_bytes() + headers + " ".join(flags).encode() + _cpu_signature().encode()
    key = hashlib.sha256(text).hexdigest()
    target = cache_dir() / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: executors starting together may race, and a rename is atomic.
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", partial, str(source), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


@cache
def decode_attention_library() -> ctypes.CDLL | None:
    """The compiled decode-attention library, or None (logged once) when it cannot be built or loaded."""
    try:
        return load_decode_attention(build())
    except OSError as exc:
        log.warning("native decode attention unavailable, using torch SDPA per request: %s", exc)
        return None


def load_decode_attention(path: Path) -> ctypes.CDLL:
    """The decode-attention library built at ``path``, its entry point typed; raises OSError."""
    library = ctypes.CDLL(str(path))
    function = library.baton_decode_attention
    function.restype = ctypes.c_int
    function.argtypes = [
        _PTR, _I64, _I64,  # query, row stride, head stride
        _PTR, _PTR, _I64, _I64,  # keys, values, slot stride, kv-head stride
        _PTR, _I64, _I64,  # out, row stride, head stride
        _PTR, _PTR, _PTR, _PTR, _I64,  # rows, lengths, table offsets, tables, count
        _I64, _I64, _I64, _I64, _I64,  # block size, sliding window (0: none), heads, kv heads, head dim
        ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # scale, is_bf16, threads, share
    ]  # fmt: skip
    return library


@cache
def prefill_attention_library() -> ctypes.CDLL | None:
    """The compiled prefill-attention library, or None (logged once) when it cannot be built or loaded."""
    try:
        library = ctypes.CDLL(str(build(PREFILL_ATTENTION_SOURCE)))
    except OSError as exc:
        log.warning("native prefill attention unavailable, using torch SDPA per prompt chunk: %s", exc)
        return None
    library.baton_prefill_attention_supported.restype = ctypes.c_int
    library.baton_prefill_attention_supported.argtypes = [_I64, ctypes.c_int]
    function = library.baton_prefill_attention
    function.restype = ctypes.c_int
    function.argtypes = [
        _PTR, _I64, _I64,  # query, row stride, head stride
        _PTR, _PTR, _I64, _I64,  # keys, values, slot stride, kv-head stride
        _PTR, _I64, _I64,  # out, row stride, head stride
        _PTR, _PTR, _PTR, _PTR, _PTR, _I64,  # rows, counts, starts, table offsets, tables, chunks
        _I64, _I64, _I64, _I64,  # block size, heads, kv heads, head dim
        ctypes.c_float, ctypes.c_int, ctypes.c_int,  # scale, is_bf16, threads
    ]  # fmt: skip
    return library


@cache
def layer_ops_library() -> ctypes.PyDLL | None:
    """The compiled layer-ops library (norm, RoPE, SiLU, argmax), or None (logged once) when unavailable."""
    try:
        library = ctypes.PyDLL(str(build(LAYER_OPS_SOURCE, LAYER_OPS_FLAGS)))
    except OSError as exc:
        log.warning("native layer ops unavailable, using torch ops: %s", exc)
        return None
    signatures = {
        # The last int of the norm, RoPE and SiLU: the threads a large call may split its rows between.
        "baton_add_rms_norm": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_int],
        "baton_rope_store": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, ctypes.c_int],
        "baton_silu_mul": [_PTR, _I64, _I64, _PTR, ctypes.c_int],
        "baton_add_rms_norm_bf16": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_int],
        "baton_rope_store_bf16": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, ctypes.c_int],
        "baton_silu_mul_bf16": [_PTR, _I64, _I64, _PTR, ctypes.c_int],
        "baton_argmax_rows": [_PTR, _I64, _I64, _I64, _PTR],
        "baton_argmax_rows_bf16": [_PTR, _I64, _I64, _I64, _PTR],
    }
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.restype = None
        function.argtypes = argtypes
    return library


@cache
def small_gemm_library() -> ctypes.PyDLL | None:
    """The compiled small-GEMM library, or None (logged once) when it cannot be built or loaded."""
    try:
        library = ctypes.PyDLL(str(build(SMALL_GEMM_SOURCE)))
    except OSError as exc:
        log.warning("native small GEMM unavailable, linear layers stay on oneDNN: %s", exc)
        return None
    function = library.baton_small_gemm_bf16
    function.restype = ctypes.c_int
    function.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64]
    return library


@cache
def token_mask_library() -> ctypes.PyDLL | None:
    """The compiled token-bitmask library, or None (logged once) when it cannot be built or loaded."""
    try:
        library = ctypes.PyDLL(str(build(TOKEN_MASK_SOURCE)))
    except OSError as exc:
        log.warning("native token bitmask unavailable, using xgrammar's kernel: %s", exc)
        return None
    function = library.baton_apply_token_bitmask
    function.restype = None
    function.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64]
    return library
