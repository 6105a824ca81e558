"""Baton's engine processes alone, and beside a small bursty load, alternated (P2's hidden cost).

End to end, the executors' engines share the cores with the scheduler, Redis and the client:
processes that wake hundreds of times a second for a fraction of a millisecond each. This runs
bench/throughput.py's phase (b) (``--engine-processes`` engines, the workload dealt between them)
alone, then beside one process that does ``--duty`` of a core of Python object churn in bursts of
about a quarter millisecond, alternating the two ``--rounds`` times. It prints each round, then the
medians and the ratios loaded / alone of the round's seconds and of the engines' CPU seconds: what
the load cost the engines beyond its own CPU.

    .venv/bin/python bench/engine_contention.py --size tiny --dtype bfloat16 --duty 0.2 --rounds 6

Not a test and not for CI (a smoke test runs it at a toy size).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throughput_engine import run_engine_processes
from throughput_setup import Setup, kv_memory_mb, make_workload

from baton.bench.local_stack import ensure_model

SIDES = ("alone", "loaded")
BURST_S = 0.00025


def bursty_load(duty: float, stop: Event) -> None:
    """Busy for bursts of BURST_S (building small dicts, as a Python service does), asleep between
    them, so that it keeps ``duty`` of one core busy."""
    sleep_s = BURST_S * (1 - duty) / duty
    scratch: dict[int, str] = {}
    while not stop.is_set():
        until = time.perf_counter() + BURST_S
        while time.perf_counter() < until:
            for i in range(64):
                scratch[i] = str(i)
        time.sleep(sleep_s)


def one_round(model: Path, setup: Setup, requests: int, duty: float | None) -> tuple[float, float]:
    """Seconds and engine CPU seconds of one phase (b) round, beside the load when ``duty`` is set."""
    wl = make_workload(requests, 0)
    stop = mp.get_context("spawn").Event()
    load = None
    if duty is not None:
        load = mp.get_context("spawn").Process(target=bursty_load, args=(duty, stop), daemon=True)
        load.start()
    try:
        result = run_engine_processes(model, wl, kv_memory_mb(model, wl), setup)
    finally:
        stop.set()
        if load is not None:
            load.join(timeout=10)
    return result.seconds, sum((result.cpu_seconds or {}).values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--engine-processes", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--duty", type=float, default=0.2, help="share of one core the load keeps busy (0-1)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per side, alternated")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "baton-contention")
    args = parser.parse_args(argv)
    if not 0 < args.duty < 1:
        parser.error("--duty must be between 0 and 1")
    if args.rounds < 1 or args.engine_processes < 2:
        parser.error("--rounds must be at least 1 and --engine-processes at least 2")
    model = ensure_model(args.workdir, args.size)
    setup = Setup(dtype=args.dtype, engine_processes=args.engine_processes)
    runs: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
    for number in range(args.rounds):
        for side in SIDES if number % 2 == 0 else SIDES[::-1]:
            seconds, cpu = one_round(model, setup, args.num_requests, args.duty if side == "loaded" else None)
            runs[side].append((seconds, cpu))
            print(f"{side}: {seconds:.3f} s, engines {cpu:.2f} CPU-s", flush=True)
    medians = {side: (statistics.median(r[0] for r in runs[side]), statistics.median(r[1] for r in runs[side]))
               for side in SIDES}  # fmt: skip
    for side, (seconds, cpu) in medians.items():
        print(f"{side}: median round {seconds:.3f} s, engines {cpu:.2f} CPU-s")
    (alone_s, alone_cpu), (loaded_s, loaded_cpu) = medians["alone"], medians["loaded"]
    print(f"loaded / alone: round seconds {loaded_s / alone_s:.3f}, engine CPU {loaded_cpu / alone_cpu:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
