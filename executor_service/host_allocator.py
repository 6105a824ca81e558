"""Keeps freed host memory in the process (glibc malloc), so that a step's tensors do not fault in fresh pages.

Why: glibc serves blocks over its mmap threshold with a fresh ``mmap`` and gives them back on free,
and it returns the top of the heap to the kernel once more than the trim threshold lies free there.
An engine step on CPU allocates and frees activations of a few MB (a prefill's MLP output is
512 x 1376 float32 = 2.8 MB on the tiny model), so every step paid a page fault per 4 KiB touched:
about 40,000 faults and 5-7 % of the engine's CPU time on the tiny workload, the prefill's MLP
matmul running at 2.5x its warm-loop time. With both thresholds raised the faults drop to zero
after the first round. This is what tcmalloc or jemalloc (which vLLM recommends preloading) give;
mallopt needs no extra library. The cost: the process keeps its peak heap instead of shrinking.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# From <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit (HEAP_MAX_SIZE / 2); larger blocks keep using mmap.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024

# The same settings as environment variables, for a process (vLLM's, in the benchmark) that we do not run.
GLIBC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # musl, macOS: no mallopt, and their allocators behave differently
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    applied = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and applied
    if not applied:
        log.warning("mallopt refused the allocator thresholds; steps may pay page faults for fresh memory")
    return applied
