"""Native CPU kernels, compiled on first use with the system C compiler and loaded through ctypes.

Why plain C and ctypes rather than a torch C++ extension: the kernel needs no torch headers, so it
builds in about a second instead of most of a minute, needs no ninja, and one ctypes call per layer
costs a few microseconds. The shared library is cached under ``BATON_KERNEL_CACHE`` (default
``~/.cache/baton/kernels``), keyed by the source, the compiler flags and the CPU, so concurrent
executors on one machine build it once and a different CPU never loads another's ``-march=native``
build. Without a compiler the executor keeps its torch path (see ``executor_service.paged_attention``).
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
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def cache_dir() -> Path:
    return Path(os.environ.get("BATON_KERNEL_CACHE") or Path.home() / ".cache" / "baton" / "kernels")


def build(source: Path = SOURCE) -> Path:
    """Compile ``source`` into the cache (once) and return the library's path; raises OSError on failure."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()
    target = cache_dir() / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: executors starting together may race, and a rename is atomic.
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", partial, str(source), "-lm"], capture_output=True, text=True)
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
        library = ctypes.CDLL(str(build()))
    except OSError as exc:
        log.warning("native decode attention unavailable, using torch SDPA per request: %s", exc)
        return None
    function = library.baton_decode_attention
    function.restype = ctypes.c_int
    function.argtypes = [
        _PTR, _I64, _I64,  # query, row stride, head stride
        _PTR, _PTR, _I64, _I64,  # keys, values, slot stride, kv-head stride
        _PTR, _I64, _I64,  # out, row stride, head stride
        _PTR, _PTR, _PTR, _PTR, _I64,  # rows, lengths, table offsets, tables, count
        _I64, _I64, _I64, _I64,  # block size, heads, kv heads, head dim
        ctypes.c_float, ctypes.c_int, ctypes.c_int,  # scale, is_bf16, threads
    ]  # fmt: skip
    return library
