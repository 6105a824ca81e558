"""bfloat16 linear layers: torch's oneDNN linear (packed weight) against the BRGeMM micro-kernel.

For each linear layer shape of a generated model (``--size``, as ``baton make-model`` makes it:
its fused q-k-v, o, fused gate-up, down and lm_head), at each row count of ``--rows``, times one
call of each path on the same input, alternating the two ``--rounds`` times, one torch thread.
``--cold`` (the engine's case) streams a buffer larger than the caches through before every call,
as attention does between a step's layers. Prints the median microseconds of each, the ratio
(oneDNN / micro-kernel: above 1 the micro-kernel is faster) and the largest difference between
their outputs, and marks the shapes the engine gives the micro-kernel (``SmallGemm.for_weight``).

    .venv/bin/python bench/linear_compare.py --size tiny --cold

Not a test and not for CI (a smoke test runs it at a toy size). Needs a CPU whose torch build
has the bf16 micro-kernel (AMX or AVX512-BF16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton.make_model import SIZES
from executor_service.kernels.small_gemm import MAX_ROWS, SmallGemm, torch_brgemm
from executor_service.packed_linear import can_pack


def layer_shapes(size: str) -> dict[str, tuple[int, int]]:
    """Each linear layer's (out_features, in_features) in ``baton make-model --size SIZE``'s model."""
    m = SIZES[size]
    head_dim = m.hidden_size // m.num_attention_heads
    return {
        "qkv": ((m.num_attention_heads + 2 * m.num_key_value_heads) * head_dim, m.hidden_size),
        "o": (m.hidden_size, m.num_attention_heads * head_dim),
        "gate_up": (2 * m.intermediate_size, m.hidden_size),
        "down": (m.hidden_size, m.intermediate_size),
        "lm_head": (m.vocab_size, m.hidden_size),
    }


def timed(call: Callable[[], torch.Tensor], before: Callable[[], None], reps: int) -> tuple[float, torch.Tensor]:
    """Median microseconds of ``reps`` calls (``before`` runs untimed ahead of each), and the output."""
    times = []
    out = call()
    for _ in range(reps):
        before()
        started = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, MAX_ROWS])
    parser.add_argument("--cold", action="store_true", help="evict the caches before every call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    if torch_brgemm() is None or not can_pack(torch.device("cpu"), torch.bfloat16):
        raise SystemExit("this CPU or torch build has no bf16 micro-kernel (needs AMX or AVX512-BF16)")
    if max(args.rows) > MAX_ROWS:
        raise SystemExit(f"--rows at most {MAX_ROWS}: the micro-kernel serves decode rows only")
    torch.set_num_threads(1)
    flush = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MB: more than the caches hold
    before = (lambda: flush.add_(1)) if args.cold else (lambda: None)
    print(f"{'layer':8} {'out x in':>12} {'rows':>5} {'oneDNN us':>10} {'kernel us':>10}", end=" ")
    print(f"{'ratio':>7} {'max diff':>9} engine")
    for name, (n, k) in layer_shapes(args.size).items():
        weight = (torch.randn(n, k) * 0.05).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        gemm = SmallGemm(weight)
        engine = "kernel" if SmallGemm.for_weight(weight, None) is not None else "oneDNN"
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()
            paths = {
                "onednn": lambda x=x, w=packed: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                "kernel": lambda x=x, g=gemm: g(x),
            }
            runs: dict[str, list[float]] = {path: [] for path in paths}
            outs = {}
            for _ in range(args.rounds):
                for path, call in paths.items():
                    us, outs[path] = timed(call, before, args.reps)
                    runs[path].append(us)
            onednn_us, kernel_us = statistics.median(runs["onednn"]), statistics.median(runs["kernel"])
            diff = (outs["onednn"].float() - outs["kernel"].float()).abs().max().item()
            shape, ratio = f"{n}x{k}", onednn_us / kernel_us
            print(f"{name:8} {shape:>12} {rows:5} {onednn_us:10.1f} {kernel_us:10.1f} {ratio:7.3f} {diff:9.2e}", engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
