"""``baton bench`` (scenario presets, a table each) and ``baton bench serve`` (after ``vllm bench serve``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from baton.bench.client import RunPlan, run_conversations, run_workload
from baton.bench.multi_turn import MultiTurnSpec
from baton.bench.prefix_scenarios import PREFIX_SCENARIOS
from baton.bench.report import ScenarioResult, print_scenarios, progress_bar, serve_text
from baton.bench.reuse import prefix_reuse, ttft_by_turn
from baton.bench.shared_prefix import ORDERS, SharedPrefixSpec, firsts_of_groups
from baton.bench.stats import parse_goodput, summarize
from baton.bench.workload import SCENARIOS, Scenario, WorkloadSpec, arrival_offsets
from baton.client_commands import add_tls_flags, tls_credentials

DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "baton-bench"
CUSTOM = Scenario("custom", "from the flags", WorkloadSpec(64, (32, 256), (16, 128)), 64)


# ---- flags -----------------------------------------------------------------------------------
def _target_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="scheduler HOST:PORT (default 127.0.0.1:50051)")
    p.add_argument("--token", help="bearer token, when the scheduler has auth on (default: $BATON_TOKEN)")
    add_tls_flags(p)
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


class _Span(argparse.Action):
    """``N`` (every one N tokens) or ``A B`` (drawn from A..B), stored as a (low, high) pair."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        spans = [int(str(v)) for v in values or ()]
        if not 1 <= len(spans) <= 2:
            parser.error(f"{option_string} takes N or A B (tokens), got {len(spans)} values")
        setattr(namespace, self.dest, (spans[0], spans[-1]))


def _prefix_flags(p: argparse.ArgumentParser) -> None:
    gsp = p.add_argument_group(
        "shared-prefix scenario", "after SGLang's generated-shared-prefix dataset; given alone, they run that scenario"
    )
    gsp.add_argument("--gsp-num-groups", "--gsp-groups", dest="gsp_num_groups", type=int, help="system prompts (8)")
    gsp.add_argument("--gsp-prompts-per-group", type=int, help="requests behind each system prompt (12)")
    gsp.add_argument("--gsp-system-prompt-len", type=int, help="tokens of each system prompt (384)")
    gsp.add_argument(
        "--gsp-question-len",
        nargs="+",
        action=_Span,
        metavar="N",
        help="tokens after the system prompt: N, or A B for A..B (16 64)",
    )
    gsp.add_argument(
        "--gsp-output-len", nargs="+", action=_Span, metavar="N", help="tokens each request asks for: N, or A B (32 96)"
    )
    gsp.add_argument("--gsp-order", choices=ORDERS, help="send order across groups (shuffled)")
    mt = p.add_argument_group("multi-turn scenario", "given alone, they run that scenario")
    mt.add_argument("--mt-conversations", type=int, help="conversations (8); --batch-size: how many at once (8)")
    mt.add_argument("--mt-turns", type=int, help="turns of each conversation (4)")
    mt.add_argument(
        "--mt-user-len",
        nargs="+",
        action=_Span,
        metavar="N",
        help="tokens of each turn's new message: N, or A B (32 64)",
    )
    mt.add_argument(
        "--mt-output-len", nargs="+", action=_Span, metavar="N", help="tokens each turn asks for: N, or A B (16 48)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Benchmark a Baton scheduler over gRPC with scenario presets (short, long, mixed, high-concurrency; "
        "shared-prefix and multi-turn when named) or your own sizes. Prompts are random token ids; decoding is "
        "greedy with EOS ignored, so each request produces exactly the tokens it asks for. Prints a table per "
        "scenario: output tok/s, TTFT and TPOT p50/p99, and for shared prefixes the mean TTFT of each group's "
        "first request against the repeats' (and, for multi-turn, the mean TTFT of each turn)."
    )
    _target_flags(p)
    presets = {**SCENARIOS, **PREFIX_SCENARIOS}
    p.add_argument(
        "--scenario",
        nargs="+",
        choices=[*presets, "all"],
        help="presets to run (default: all, unless sizes are given: then one custom run; all is the first four). "
        + "; ".join(f"{s.name}: {s.description}" for s in presets.values()),
    )
    p.add_argument("--num-requests", type=int, help="requests per scenario (overrides the first four presets)")
    p.add_argument("--batch-size", type=int, help="most requests (multi-turn: conversations) in flight at once")
    _length_flags(p, aliases=False)
    _prefix_flags(p)
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


def _given(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The flags named ``prefix``* that were given, by the spec field they set."""
    return {k.removeprefix(prefix): v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}


def _overlay(base: Scenario, args: argparse.Namespace) -> Scenario:
    """``base`` with the flags given laid over it: the size flags on the random presets, the gsp/mt flags
    on the prefix ones; ``--seed`` and ``--batch-size`` on all."""
    wl = base.workload
    workload: WorkloadSpec | SharedPrefixSpec | MultiTurnSpec
    if isinstance(wl, SharedPrefixSpec):
        workload = dataclasses.replace(wl, **_given(args, "gsp_"), seed=args.seed)
    elif isinstance(wl, MultiTurnSpec):
        workload = dataclasses.replace(wl, **_given(args, "mt_"), seed=args.seed)
    else:
        workload = WorkloadSpec(
            num_requests=args.num_requests or wl.num_requests,
            input_len=_lengths(args, "input_len", wl.input_len),
            output_len=_lengths(args, "output_len", wl.output_len),
            seed=args.seed,
        )
    return dataclasses.replace(base, workload=workload, batch_size=args.batch_size or base.batch_size)


def scenarios_from(args: argparse.Namespace) -> list[Scenario]:
    """The presets named (or all), with any size flags laid over them; or one custom scenario.

    Without --scenario, shared-prefix or multi-turn flags run those scenarios (size flags then add a
    custom run); with none of them, sizes make one custom run and no sizes every random preset.
    """
    lengths = any(getattr(args, n) is not None for n in ("num_requests", "input_len", "output_len"))
    lengths = lengths or bool(args.input_len_range or args.output_len_range)
    if args.scenario:
        names = list(SCENARIOS) if "all" in args.scenario else []
        names += [n for n in args.scenario if n != "all" and n not in names]
        bases = [{**SCENARIOS, **PREFIX_SCENARIOS}[n] for n in names]
    else:
        flagged = [name for name, prefix in (("shared-prefix", "gsp_"), ("multi-turn", "mt_")) if _given(args, prefix)]
        bases = [PREFIX_SCENARIOS[n] for n in flagged]
        if lengths or (args.batch_size is not None and not flagged):
            bases.append(CUSTOM)
        bases = bases or list(SCENARIOS.values())
    return [_overlay(base, args) for base in bases]


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
    token = args.token or os.environ.get("BATON_TOKEN", "")  # as the other client commands read it
    return (("authorization", f"Bearer {token}"),) if token else ()


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if not args.local:
        return tls_credentials(args)
    if args.tls_ca or args.tls_cert or args.tls_key:
        raise SystemExit("baton bench: the --tls-* flags are for --target; a --local stack serves plaintext")
    return None


async def _run_one(target: str, scenario: Scenario, args: argparse.Namespace, warm_up: bool) -> ScenarioResult:
    wl = scenario.workload
    plan = RunPlan(scenario.batch_size, None, args.timeout, _metadata(args), _credentials(args))
    turns: tuple[float, ...] = ()
    with progress_bar(wl.num_requests, f"{scenario.name}", enabled=not args.no_progress) as bar:
        if isinstance(wl, MultiTurnSpec):
            by_conversation, seconds = await run_conversations(target, wl.build(), plan, bar, warm_up)
            timings = [t for conversation in by_conversation for t in conversation]
            firsts = [turn == 0 for conversation in by_conversation for turn in range(len(conversation))]
            turns = ttft_by_turn(by_conversation)
            streams = len(by_conversation)
        else:
            specs = wl.build()
            timings, seconds = await run_workload(target, specs, plan, bar, warm_up)
            firsts = firsts_of_groups(specs)
            streams = len(specs)
    summary = summarize(timings, seconds)
    return ScenarioResult(
        scenario.name,
        scenario.description,
        min(scenario.batch_size, streams),  # what was in flight at most, not the limit alone
        wl.input_len,
        wl.output_len,
        summary,
        prefix_reuse(firsts, timings),
        turns,
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
    plan = RunPlan(concurrency, offsets, args.timeout, _metadata(args), _credentials(args))
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
