"""``baton bench`` (scenario presets, a table each) and ``baton bench serve`` (after ``vllm bench serve``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from baton.bench.client import RunPlan, run_workload
from baton.bench.report import ScenarioResult, print_scenarios, progress_bar, serve_text
from baton.bench.stats import parse_goodput, summarize
from baton.bench.workload import SCENARIOS, Scenario, WorkloadSpec, arrival_offsets

DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "baton-bench"
CUSTOM = Scenario("custom", "from the flags", WorkloadSpec(64, (32, 256), (16, 128)), 64)


# ---- flags -----------------------------------------------------------------------------------
def _target_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="scheduler HOST:PORT (default 127.0.0.1:50051)")
    p.add_argument("--token", help="bearer token, when the scheduler has auth on")
    p.add_argument(
        "--local", action="store_true", help="start redis-server, an executor and a scheduler here and bench those"
    )
    p.add_argument("--model", help="with --local: model dir (default: the generated tiny model, made once)")
    p.add_argument("--dtype", help="with --local: executor dtype, float32 (default), bfloat16 or float16")
    p.add_argument("--config", help="with --local: YAML config passed to both services")
    p.add_argument("--executors", type=int, default=1, help="with --local: executor processes to start (default 1)")
    p.add_argument(
        "--workdir", default=str(DEFAULT_WORKDIR), help=f"with --local: models and logs (default {DEFAULT_WORKDIR})"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each request may take (default 600)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _length_flags(p: argparse.ArgumentParser, *, aliases: bool) -> None:
    inp = p.add_mutually_exclusive_group()
    names = ["--input-len", "--random-input-len"] if aliases else ["--input-len"]
    inp.add_argument(*names, dest="input_len", type=int, help="every prompt has this many tokens")
    inp.add_argument("--input-len-range", nargs=2, type=int, metavar=("A", "B"), help="prompt lengths drawn from A..B")
    out = p.add_mutually_exclusive_group()
    names = ["--output-len", "--random-output-len"] if aliases else ["--output-len"]
    out.add_argument(*names, dest="output_len", type=int, help="every request asks for this many tokens")
    out.add_argument("--output-len-range", nargs=2, type=int, metavar=("A", "B"), help="output lengths drawn from A..B")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Benchmark a Baton scheduler over gRPC with scenario presets (short, long, mixed, high-concurrency) or "
        "your own sizes. Prompts are random token ids; decoding is greedy with EOS ignored, so each request "
        "produces exactly the tokens it asks for. Prints a table per scenario: output tok/s, TTFT and TPOT p50/p99."
    )
    _target_flags(p)
    p.add_argument(
        "--scenario",
        nargs="+",
        choices=[*SCENARIOS, "all"],
        help="presets to run (default: all, unless sizes are given: then one custom run). "
        + "; ".join(f"{s.name}: {s.description}" for s in SCENARIOS.values()),
    )
    p.add_argument("--num-requests", type=int, help="requests per scenario (overrides the preset)")
    p.add_argument("--batch-size", type=int, help="most requests in flight at once (overrides the preset)")
    _length_flags(p, aliases=False)
    p.add_argument("--json", help="also write the results here as JSON")
    p.set_defaults(func=run_scenarios)
    sub = p.add_subparsers(dest="bench_command", metavar="{serve}")
    serve = sub.add_parser("serve", help="open-loop serving benchmark after `vllm bench serve`")
    add_serve_arguments(serve)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Serving benchmark modeled on `vllm bench serve`: requests arrive as a Poisson (or gamma) process at "
        "--request-rate, at most --max-concurrency in flight. Reports TTFT, TPOT, ITL and end-to-end latency "
        "(mean, p50, p90, p99), request and token throughput, and goodput against --goodput SLOs."
    )
    _target_flags(p)
    p.add_argument(
        "--num-prompts", "--num-requests", dest="num_prompts", type=int, default=200, help="requests (default 200)"
    )
    _length_flags(p, aliases=True)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests per second (default inf: all at once)"
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed gaps: 1 is Poisson, < 1 burstier, > 1 more regular (default 1)",
    )
    p.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    p.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        default=[],
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000",
    )
    p.add_argument("--save-result", action="store_true", help="write the settings and results to a JSON file")
    p.add_argument("--result-dir", default=".", help="where --save-result writes (default: here)")
    p.add_argument("--result-filename", help="file name for --save-result (default baton-bench-serve-TIME.json)")
    p.set_defaults(func=run_serve)


def _lengths(args: argparse.Namespace, name: str, default: tuple[int, int]) -> tuple[int, int]:
    fixed, span = getattr(args, name), getattr(args, f"{name}_range")
    if fixed is not None:
        return (fixed, fixed)
    return (span[0], span[1]) if span else default


def scenarios_from(args: argparse.Namespace) -> list[Scenario]:
    """The presets named (or all), with any size flags laid over them; or one custom scenario."""
    sized = any(getattr(args, n) is not None for n in ("num_requests", "batch_size", "input_len", "output_len"))
    sized = sized or bool(args.input_len_range or args.output_len_range)
    names = list(SCENARIOS) if not args.scenario or "all" in args.scenario else args.scenario
    bases = [SCENARIOS[n] for n in names] if args.scenario or not sized else [CUSTOM]
    out = []
    for base in bases:
        wl = base.workload
        workload = WorkloadSpec(
            num_requests=args.num_requests or wl.num_requests,
            input_len=_lengths(args, "input_len", wl.input_len),
            output_len=_lengths(args, "output_len", wl.output_len),
            seed=args.seed,
        )
        out.append(dataclasses.replace(base, workload=workload, batch_size=args.batch_size or base.batch_size))
    return out


# ---- running ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _target(args: argparse.Namespace) -> Iterator[str]:
    if not args.local:
        yield args.target
        return
    from baton.bench.local_stack import ensure_model, local_stack

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else ensure_model(workdir, "tiny", progress=True)
    overrides = {"BATON_EXECUTOR__DTYPE": args.dtype} if args.dtype else {}
    print(f"[bench] starting a local stack on {model} (logs in {workdir / 'logs'})", file=sys.stderr)
    with local_stack(model, workdir / "logs", overrides, args.config, executors=args.executors) as stack:
        yield stack.target


def _metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {args.token}"),) if args.token else ()


async def _run_one(target: str, scenario: Scenario, args: argparse.Namespace, warm_up: bool) -> ScenarioResult:
    specs = scenario.workload.build()
    plan = RunPlan(scenario.batch_size, timeout_s=args.timeout, metadata=_metadata(args))
    with progress_bar(len(specs), f"{scenario.name}", enabled=not args.no_progress) as bar:
        timings, seconds = await run_workload(target, specs, plan, bar, warm_up)
    wl = scenario.workload
    summary = summarize(timings, seconds)
    return ScenarioResult(
        scenario.name, scenario.description, scenario.batch_size, wl.input_len, wl.output_len, summary
    )


def run_scenarios(args: argparse.Namespace) -> int:
    logging.basicConfig(level="WARNING")
    scenarios = scenarios_from(args)
    results: list[ScenarioResult] = []
    with _target(args) as target:
        for i, scenario in enumerate(scenarios):
            result = asyncio.run(_run_one(target, scenario, args, warm_up=i == 0))
            print_scenarios([result])
            results.append(result)
    if len(results) > 1:
        print_scenarios(results)
    if args.json:
        rows = [{**dataclasses.asdict(r), "summary": r.summary.to_dict()} for r in results]
        Path(args.json).write_text(json.dumps({"target": args.target, "local": args.local, "results": rows}, indent=2))
    return 1 if any(r.summary.failed for r in results) else 0


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level="WARNING")
    slos = parse_goodput(args.goodput)
    workload = WorkloadSpec(
        args.num_prompts, _lengths(args, "input_len", (256, 256)), _lengths(args, "output_len", (64, 64)), args.seed
    )
    specs = workload.build()
    offsets = arrival_offsets(len(specs), args.request_rate, args.burstiness, args.seed)
    concurrency = args.max_concurrency or len(specs)
    plan = RunPlan(concurrency, offsets, args.timeout, _metadata(args))
    print(
        f"[bench] {len(specs)} requests, prompt {workload.input_len}, output {workload.output_len}, "
        f"rate {args.request_rate} req/s, burstiness {args.burstiness}, max concurrency {args.max_concurrency}",
        file=sys.stderr,
    )
    with _target(args) as target, progress_bar(len(specs), "serve", enabled=not args.no_progress) as bar:
        timings, seconds = asyncio.run(run_workload(target, specs, plan, bar))
    summary = summarize(timings, seconds, slos)
    print(serve_text(summary))
    if args.save_result:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(args.result_dir) / (args.result_filename or f"baton-bench-serve-{stamp}.json")
        settings = {
            "backend": "baton-grpc",
            "target": "local" if args.local else args.target,
            "num_prompts": len(specs),
            "input_len": list(workload.input_len),
            "output_len": list(workload.output_len),
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "goodput": slos,
            "seed": args.seed,
            "date": stamp,
        }
        errors = sorted({t.error for t in timings if t.error})
        path.write_text(json.dumps({**settings, **summary.to_dict(), "errors": errors}, indent=2) + "\n")
        print(f"[bench] results saved to {path}", file=sys.stderr)
    return 1 if summary.failed else 0
