"""Output-token throughput of Baton against plain transformers, on one fixed workload.

Same requests (default 64: prompts of 32-256 random ids starting with BOS, outputs of 16-128
tokens, greedy, EOS ignored) and same generated model (float32 on CPU by default) in every
phase: (a) Baton end to end, redis-server + executor + scheduler processes, gRPC Generate
streams; (b) Baton's engine loop in process; (c) HF ``generate`` in static batches of 16 (left
padding); (d) transformers' continuous batching, ``generate_batch``. Each phase first runs the
whole workload once, untimed (``--short-warmup``: one short request instead). tok/s = tokens the
requests asked for / seconds from the first submit to the last finish; padding tokens that (c)
and (d) compute are not counted. On a GPU (``--device cuda --dtype bfloat16 --sizes 1b``) phases (a) and
(b) also report the device load (NVML) sampled during their window.

Run from the repository root: ``python -m bench.throughput --sizes tiny`` (``--help`` for the flags).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers

from baton.make_model import SIZES, make_model
from bench.throughput_e2e import RPCS, run_baton_e2e
from bench.throughput_engine import run_engine
from bench.throughput_hf import run_hf_cb, run_hf_static
from bench.throughput_setup import DTYPES, MAX_BATCH, Result, Setup, Workload, kv_memory_mb, make_workload, say

# What each ratio of phase (a)'s tok/s to another phase's says.
MEANINGS = {
    "a/b": "Baton end to end over its engine alone: the share of the engine's speed left after the scheduler, "
    "Redis and gRPC",
    "a/c": "Baton end to end over HF generate in static batches",
    "a/d": "Baton end to end over transformers' continuous batching",
}


# ---- report --------------------------------------------------------------------------------
def ratios(results: dict[str, Result]) -> dict[str, float | None]:
    a = results["a"].tok_s if "a" in results else None
    return {f"a/{k}": a / r.tok_s if a and r.tok_s else None for k, r in results.items() if k != "a"}


def same_as_engine(results: dict[str, Result], key: str) -> str:
    ref, got = (results["b"].outputs if "b" in results else None), results[key].outputs
    return "-" if ref is None or got is None else f"{sum(r == g for r, g in zip(ref, got, strict=True))}/{len(ref)}"


def print_report(size: str, results: dict[str, Result], wl: Workload, threads: int) -> None:
    prompt_tokens = sum(map(len, wl.prompts))
    print(f"\n== {size} model: {len(wl.prompts)} requests, {prompt_tokens} prompt tokens, HF threads {threads} ==")
    print(f"{'phase':<30}{'tok/s':>9}{'seconds':>9}{'useful tok':>12}{'computed tok':>14}{'load':>6}  same as (b)")
    for key, res in results.items():
        tok_s = f"{res.tok_s:9.1f}" if res.tok_s else f"{'n/a':>9}"
        cells = f"{tok_s}{res.seconds:9.2f}{res.useful_tokens:12d}{res.computed_tokens:14d}{res.load:6.1f}"
        print(f"{res.label:<30}{cells}  {same_as_engine(results, key)}")
    for name, value in ratios(results).items():
        print(f"{name} = {'n/a' if value is None else f'{value:.3f}'}{_meaning(name)}")
    for key, res in results.items():
        if res.note:
            print(f"note {key}: {res.note}")
        if res.device_load:
            print(f"device load {key}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.device_load.items()))


def median_ratios(repeats: list[dict[str, float | None]]) -> dict[str, float]:
    """Each ratio's median over the repeats that measured it."""
    names = {name for ratios_of_one in repeats for name in ratios_of_one}
    found = {name: [v for r in repeats if (v := r.get(name)) is not None] for name in sorted(names)}
    return {name: statistics.median(values) for name, values in found.items() if values}


def print_repeats(size: str, repeats: list[dict[str, float | None]]) -> None:
    """The ratios of every repeat, then their medians: a slow minute of a shared machine moves one
    repeat, not the median."""
    print(f"\n== {size} model: {len(repeats)} repeats of the phases, alternated ==")
    for name, median in median_ratios(repeats).items():
        each = " ".join("n/a" if r.get(name) is None else f"{r[name]:.3f}" for r in repeats)
        print(f"median {name} = {median:.3f} over {each}{_meaning(name)}")


def _meaning(name: str) -> str:
    return f"  ({MEANINGS[name]})" if name in MEANINGS else ""


def run_size(
    size: str,
    wl: Workload,
    workdir: Path,
    phases: list[str],
    setup: Setup,
    on_phase: Callable[[dict[str, Result]], None] = lambda results: None,
) -> dict[str, Result]:
    """Run ``phases`` in order; ``on_phase`` sees the results so far after each one."""
    suffix = "" if setup.dtype == "float32" else f"-{setup.dtype}"
    model_dir, logs = workdir / f"model-{size}{suffix}", workdir / f"logs-{size}{suffix}"
    if not (model_dir / "model.safetensors").exists():
        say(f"generating the {size} model ({setup.dtype}) into {model_dir}")
        make_model(model_dir, size=size, seed=0, dtype=setup.dtype)
    logs.mkdir(exist_ok=True)
    kv_mb = setup.kv_mb or kv_memory_mb(model_dir, wl, setup.block_size)
    say(f"== {size}: {model_dir}, {setup}, KV cache {kv_mb} MiB, {len(wl.prompts)} requests ==")
    runners = {
        "a": lambda: run_baton_e2e(model_dir, wl, kv_mb, logs, setup),
        "b": lambda: run_engine(model_dir, wl, kv_mb, setup),
        "c": lambda: run_hf_static(model_dir, wl, setup),
        "d": lambda: run_hf_cb(model_dir, wl, setup),
    }
    results: dict[str, Result] = {}
    for key in phases:
        results[key] = runners[key]()
        gc.collect()
        on_phase(results)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="workload seed (the models always use seed 0)")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "baton-bench"))
    parser.add_argument("--json", help="also write the results here as JSON")
    parser.add_argument("--phases", nargs="+", default=list("abcd"), choices=list("abcd"), help="phases to run")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the phases this many times in turn (a b a b ...) and print each ratio's median (default 1)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto, for Baton and HF alike (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model and KV dtype")
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH, help="running requests at most (Baton)")
    parser.add_argument("--token-budget", type=int, default=512, help="tokens per engine step (Baton)")
    parser.add_argument("--kv-cache-mb", type=int, default=0, help="Baton's KV cache (default: fits the workload)")
    parser.add_argument("--stream-interval", type=int, default=1, help="(a): tokens per stream write (default 1)")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch threads of (c) and (d) (0: default)")
    parser.add_argument(
        "--executor-threads", type=int, default=0, help="Baton torch threads, (a) and (b); 0: the executor default"
    )
    parser.add_argument(
        "--executors", type=int, default=1, help="(a): executor processes, each with the whole model (default 1)"
    )
    parser.add_argument(
        "--engine-processes",
        type=int,
        default=1,
        help="(b): engine processes, the workload dealt between them (default 1); match --executors to hold "
        "an end-to-end run with N executors against N engines",
    )
    parser.add_argument(
        "--request-stream-interval",
        type=int,
        default=0,
        help="(a): each request's own stream_interval_tokens, tokens per message for it (default 0: none)",
    )
    parser.add_argument(
        "--rpc",
        default="generate",
        choices=RPCS,
        help="(a): a Generate stream per request (default), or the workload over one GenerateBatch stream",
    )
    parser.add_argument(
        "--short-warmup",
        action="store_true",
        help="warm each phase with one short request only (default: the whole workload once, untimed)",
    )
    parser.add_argument(
        "--report-every-steps",
        type=int,
        default=1,
        help="(a): the executors' report_every_steps, decode steps merged into one step report (default 1)",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=("on", "off"),
        default="on",
        help="(a) and (b): executor.cuda_graphs, decode steps replayed as CUDA graphs (default on; CUDA only)",
    )
    parser.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="(a) and (b): executor.async_scheduling, decode steps launched before the last one's tokens are "
        "read (default auto: on CUDA)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="(a) and (b): executor.block_size, tokens per KV block (default 16; on CUDA a multiple of 256 lets "
        "decodes read the cache in place)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM takes the same cleanup path as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    transformers.utils.logging.disable_progress_bar()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    wl = make_workload(args.num_requests, args.seed)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    threads = torch.get_num_threads()
    setup = Setup(
        args.device,
        args.dtype,
        args.max_batch,
        args.token_budget,
        args.kv_cache_mb,
        args.executor_threads,
        args.stream_interval,
        args.executors,
        args.rpc,
        args.engine_processes,
        args.request_stream_interval,
        args.report_every_steps,
        not args.short_warmup,
        args.cuda_graphs == "on",
        args.async_scheduling,
        args.block_size,
    )
    report: dict[str, Any] = {"requests": len(wl.prompts), "seed": args.seed, "wanted_tokens": sum(wl.max_tokens)}
    report |= {"torch": torch.__version__, "transformers": transformers.__version__, "torch_threads": threads}
    report |= {"cpus": os.cpu_count(), "setup": asdict(setup), "sizes": {}}
    if setup.torch_device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(setup.torch_device)
    try:
        for size in args.sizes:
            repeats: list[dict[str, float | None]] = []

            def record(
                results: dict[str, Result], size: str = size, repeats: list[dict[str, float | None]] = repeats
            ) -> None:
                # Written after every phase, so a run cut short still leaves what it measured.
                rows = {k: {f: v for f, v in asdict(r).items() if f != "outputs"} for k, r in results.items()}
                report["sizes"][size] = {"results": rows, "ratios": ratios(results)}
                if repeats:
                    report["sizes"][size] |= {"repeats": repeats, "median_ratios": median_ratios(repeats)}
                if args.json:
                    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")

            for _ in range(args.repeats):
                results = run_size(size, wl, workdir, args.phases, setup, record)
                print_report(size, results, wl, threads)
                repeats.append(ratios(results))
                record(results)
            if args.repeats > 1:
                print_repeats(size, repeats)
    except KeyboardInterrupt:
        say("interrupted; services stopped")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
