"""Decode attention over a shared prompt prefix: read together against read alone, in one process.

One layer call of the native decode-attention kernel on the shape of the shared-prefix workload:
``--groups`` prompt prefixes of ``--prefix-blocks`` cached blocks, each followed by ``--per-group``
decodes with their own 2-10 blocks past it (question and output so far), the decodes in a shuffled
order as a step holds them. It times the call with the shared blocks read once for all the decodes
on them (the default) against each decode reading its whole context alone (``share=False``),
alternating the two ``--pairs`` times, checks that both give bit for bit the same outputs, and
prints the median of alone / together (above 1: reading together is faster).

    python -m bench.shared_prefix_attention --dtype bfloat16 --heads 4 --kv-heads 2   # the tiny model
    python -m bench.shared_prefix_attention --dtype bfloat16 --heads 12 --kv-heads 12  # the small model
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from executor_service.kernels.decode_attention import PagedDecodes, available, decode_attention


def build(args: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, PagedDecodes, int]:
    """Queries [1, H, N, d], one pool [slots, Hkv, d] (keys and values alike) and the decodes' tables."""
    rng = random.Random(args.seed)
    size = args.block_size
    blocks = args.groups * (args.prefix_blocks + args.per_group * 10) + 1
    free = list(range(blocks))
    rng.shuffle(free)
    lengths: list[int] = []
    tables: list[list[int]] = []
    for _ in range(args.groups):
        prefix = [free.pop() for _ in range(args.prefix_blocks)]
        for _ in range(args.per_group):
            length = (args.prefix_blocks + rng.randrange(1, 10)) * size + rng.randrange(1, size + 1)
            tables.append(prefix + [free.pop() for _ in range(-(-length // size) - args.prefix_blocks)])
            lengths.append(length)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    decodes = PagedDecodes.build(order, [lengths[i] for i in order], [tables[i] for i in order])
    torch.manual_seed(args.seed)
    pool = torch.randn(blocks * size, args.kv_heads, args.head_dim).to(dtype)
    query = torch.randn(1, args.heads, len(lengths), args.head_dim).to(dtype)
    return query, pool, decodes, sum(lengths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=12)
    parser.add_argument("--prefix-blocks", type=int, default=24, help="cached blocks each group shares (384 tokens)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads the kernel may use")
    parser.add_argument("--calls", type=int, default=200, help="layer calls timed per side and pair")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not available(torch.device("cpu"), dtype):
        print("the native decode-attention kernel is not available here (no C compiler?)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    query, pool, decodes, tokens = build(args, dtype)
    outputs = {share: torch.empty(query.shape[2], args.heads, args.head_dim, dtype=dtype) for share in (True, False)}
    scale = args.head_dim**-0.5

    def timed(share: bool) -> float:
        out = outputs[share]
        for _ in range(10):
            decode_attention(query, pool, pool, decodes, args.block_size, scale, out, share=share)
        started = time.perf_counter()
        for _ in range(args.calls):
            decode_attention(query, pool, pool, decodes, args.block_size, scale, out, share=share)
        return (time.perf_counter() - started) / args.calls * 1e6

    ratios = []
    print(f"{query.shape[2]} decodes, {tokens} context tokens, {args.dtype}, {args.threads} thread(s)")
    for pair in range(args.pairs):
        together, alone = timed(True), timed(False)
        ratios.append(alone / together)
        print(
            f"pair {pair + 1}: together {together:.0f} us, alone {alone:.0f} us a layer call; "
            f"alone/together {alone / together:.2f}"
        )
    if not torch.equal(outputs[True], outputs[False]):
        print("the outputs differ between reading together and alone", file=sys.stderr)
        return 1
    print(f"median alone/together: {statistics.median(ratios):.2f} (outputs bit for bit the same)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
