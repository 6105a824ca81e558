"""The native decode-attention kernel against an earlier build of itself, alternated in one process.

Builds ``executor_service/kernels/decode_attention.c`` (with the headers beside it) as it is in
``--baseline-rev`` (a git revision) or in ``--baseline-dir``, and as it is in the working tree,
loads both, and times one call of each over the same paged contexts, alternating the two
``--rounds`` times. Prints each shape's median microseconds per call, the speedup (baseline / new)
and the largest difference between the two outputs. Shapes: the tiny model's (4 heads, 2 KV heads
of 64) and the small model's (12 x 12 of 64), ``--decodes`` requests of ``--length`` tokens each,
in blocks of 16 scattered over a pool.

    .venv/bin/python bench/kernel_compare.py --baseline-rev HEAD~1 --dtypes bfloat16 float32

Not a test and not for CI (a smoke test runs it at a toy size).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from executor_service import kernels
from executor_service.kernels import decode_attention as da

SHAPES = {"tiny": (4, 2, 64), "small": (12, 12, 64)}  # heads, KV heads, head dim
KERNEL_DIR = Path(kernels.__file__).resolve().parent
BLOCK = 16
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, da.PagedDecodes]  # query, keys, values, decodes


def baseline_sources(rev: str | None, directory: Path | None, into: Path) -> Path:
    """The baseline's decode_attention.c, with its headers, copied or checked out into ``into``."""
    names = ["decode_attention.c", *(p.name for p in KERNEL_DIR.glob("*.h"))]
    for name in names:
        if directory is not None:
            text = (directory / name).read_text()
        else:
            path = f"{KERNEL_DIR.relative_to(KERNEL_DIR.parents[1]).as_posix()}/{name}"
            done = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, cwd=KERNEL_DIR)
            if done.returncode != 0:
                raise SystemExit(f"git show {rev}:{path} failed: {done.stderr.strip()}")
            text = done.stdout
        (into / name).write_text(text)
    return into / "decode_attention.c"


def load_baseline(source: Path) -> ctypes.CDLL:
    """The baseline's library, with the working tree's signature (the kernel's arguments are unchanged)."""
    current = kernels.decode_attention_library()
    if current is None:
        raise SystemExit("the native decode kernel cannot be built here (no C compiler?)")
    library = ctypes.CDLL(str(kernels.build(source)))
    library.baton_decode_attention.argtypes = current.baton_decode_attention.argtypes
    library.baton_decode_attention.restype = current.baton_decode_attention.restype
    return library


def contexts(shape: str, dtype: torch.dtype, decodes: int, length: int) -> Case:
    heads, kv_heads, dim = SHAPES[shape]
    blocks_each = -(-length // BLOCK)
    num_blocks = max(4096, 2 * decodes * blocks_each)
    keys = torch.randn(num_blocks * BLOCK, kv_heads, dim).to(dtype)
    values = torch.randn(num_blocks * BLOCK, kv_heads, dim).to(dtype)
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(blocks_each)] for _ in range(decodes)]
    query = torch.randn(1, heads, decodes, dim).to(dtype)
    return query, keys, values, da.PagedDecodes.build(list(range(decodes)), [length] * decodes, tables)


def time_call(library: ctypes.CDLL, case: Case, reps: int) -> tuple[float, torch.Tensor]:
    """Median microseconds of ``reps`` calls through ``library``, and its output."""
    query, keys, values, decodes = case
    out = torch.empty(query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype)
    current = da.decode_attention_library
    # The wrapper looks the library up on each call; point it at the one being timed.
    da.decode_attention_library = lambda: library  # type: ignore[assignment]
    try:
        da.decode_attention(query, keys, values, decodes, BLOCK, 0.125, out)
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            da.decode_attention(query, keys, values, decodes, BLOCK, 0.125, out)
            times.append(time.perf_counter() - started)
    finally:
        da.decode_attention_library = current  # type: ignore[assignment]
    return 1e6 * statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--baseline-rev", default="HEAD", help="git revision of the baseline source (default HEAD)")
    which.add_argument("--baseline-dir", type=Path, help="a directory holding the baseline source instead")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    parser.add_argument("--decodes", type=int, default=33)
    parser.add_argument("--length", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kernel-baseline-") as tmp:
        baseline = load_baseline(baseline_sources(args.baseline_rev, args.baseline_dir, Path(tmp)))
    new = kernels.decode_attention_library()
    assert new is not None  # load_baseline exits without it
    print(f"{'shape':6} {'dtype':9} {'baseline us':>12} {'new us':>9} {'speedup':>8} {'max diff':>9}")
    for shape in args.shapes:
        for dtype_name in args.dtypes:
            case = contexts(shape, getattr(torch, dtype_name), args.decodes, args.length)
            runs: dict[str, list[float]] = {"baseline": [], "new": []}
            outs = {}
            for _ in range(args.rounds):
                for name, library in (("baseline", baseline), ("new", new)):
                    us, outs[name] = time_call(library, case, args.reps)
                    runs[name].append(us)
            old_us, new_us = statistics.median(runs["baseline"]), statistics.median(runs["new"])
            diff = (outs["baseline"].float() - outs["new"].float()).abs().max().item()
            print(f"{shape:6} {dtype_name:9} {old_us:12.0f} {new_us:9.0f} {old_us / new_us:8.3f} {diff:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
