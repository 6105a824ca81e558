"""Baton end to end, the working tree against a baseline tree: two local stacks, rounds alternated.

The baseline is ``--baseline-rev`` (a git revision, exported with ``git archive``) or
``--baseline-dir``; its stack's processes run it through ``PYTHONPATH``, on the same venv. Both
stacks (redis-server, ``--executors`` executors, a scheduler each) are up at once, each idle while
the other runs a round of bench/throughput.py's workload over ``GenerateBatch``.

Which stack started first matters on a small VM: with the same tree on both sides, the
first-started one was slower by 0.5-7 % (docs/benchmarks.md, "Eleventh round"). So the rounds run
in two halves, the stacks started in one order for the first and restarted in the other for the
second, and in each half the rounds alternate A B, B A. Prints each round, then the median round
seconds and CPU of each side, and the ratio baseline / working tree (above 1: the working tree is
faster). Run it with the working tree as its own baseline (``--baseline-dir .``) to see the noise.

    .venv/bin/python bench/tree_compare.py --baseline-rev HEAD~1 --rounds 12

Not a test and not for CI (a smoke test runs it at a toy size).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput_e2e import drive_grpc
from throughput_setup import MAX_BATCH, Workload, kv_memory_mb, make_workload

from baton.bench.local_stack import LocalStack, ensure_model, local_stack

REPO = Path(__file__).resolve().parent.parent
SIDES = ("working tree", "baseline")


def export_revision(rev: str, into: Path) -> Path:
    """``git archive REV`` unpacked into ``into``."""
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {rev} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def one_round(stack: LocalStack, wl: Workload, interval: int) -> tuple[float, float, float]:
    """Seconds, executors' CPU-s and the scheduler's CPU-s of one round."""
    before = stack.cpu_seconds()
    result = asyncio.run(drive_grpc(stack.target, wl, stack.pids, "batch", interval))
    after = stack.cpu_seconds()
    executors = sum(after[k] - before[k] for k in after if k.startswith("executor"))
    return result.seconds, executors, after["scheduler"] - before["scheduler"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--baseline-rev", help="git revision of the baseline")
    which.add_argument("--baseline-dir", type=Path, help="a directory holding the baseline tree instead")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--request-stream-interval", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12, help="rounds per side, split over the two halves")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "baton-tree-compare")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        raise SystemExit("--rounds must be at least 2 (one per half)")
    model = ensure_model(args.workdir, args.size)
    wl = make_workload(args.num_requests, 0)
    env = {
        "BATON_EXECUTOR__DTYPE": args.dtype,
        "BATON_EXECUTOR__KV_CACHE_MEMORY_MB": str(kv_memory_mb(model, wl)),
        "BATON_SCHEDULER__BATCH_LEVEL__MAX_BATCH_SIZE": str(MAX_BATCH),
    }
    runs: dict[str, list[tuple[float, float, float]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="baseline-") as tmp:
        baseline = args.baseline_dir or export_revision(args.baseline_rev, Path(tmp))
        envs = {SIDES[0]: env, SIDES[1]: {**env, "PYTHONPATH": str(Path(baseline).resolve())}}
        halves = (args.rounds + 1) // 2, args.rounds // 2
        for half, (rounds, order) in enumerate(zip(halves, (SIDES, SIDES[::-1]), strict=True)):
            with contextlib.ExitStack() as stacks:
                up = {side: stacks.enter_context(local_stack(model, args.workdir / f"logs-{half}-{i}", envs[side],
                                                             executors=args.executors))
                      for i, side in enumerate(order)}  # fmt: skip
                for side in order:
                    one_round(up[side], wl, args.request_stream_interval)  # warm-up, untimed
                for number in range(rounds):
                    for side in order if number % 2 == 0 else order[::-1]:
                        seconds, executors, scheduler = one_round(up[side], wl, args.request_stream_interval)
                        runs[side].append((seconds, executors, scheduler))
                        print(f"half {half + 1}, {side}: {seconds:.3f} s, executors {executors:.2f} CPU-s, "
                              f"scheduler {scheduler:.2f} CPU-s", flush=True)  # fmt: skip
    medians = {side: [statistics.median(r[i] for r in runs[side]) for i in range(3)] for side in SIDES}
    for side in SIDES:
        seconds, executors, scheduler = medians[side]
        print(f"{side}: median round {seconds:.3f} s, executors {executors:.2f} CPU-s, scheduler {scheduler:.2f} CPU-s")
    print(f"baseline / working tree (median round seconds): {medians[SIDES[1]][0] / medians[SIDES[0]][0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
