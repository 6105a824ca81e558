"""The ``baton`` command: one subcommand per job, each with --help for every flag."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import sys
from collections.abc import Callable

from baton import make_model


def _common_service_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (see docs/configuration.md); BATON_* env vars override it")
    parser.add_argument("--redis-url", help="Redis URL, e.g. redis://127.0.0.1:6379/0 (overrides the config)")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (overrides the config)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: off)")


def _add_scheduler(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scheduler", help="run a scheduler replica (the public gRPC API)")
    _common_service_flags(p)
    p.add_argument("--port", type=int, help="public gRPC port (default 50051)")
    p.add_argument("--host", help="address to bind (default 0.0.0.0)")
    p.add_argument("--tokenizer", help="tokenizer dir or hub id; default: the model executors register")
    p.set_defaults(func=_run_scheduler)


def _add_executor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("executor", help="run an executor: a model with continuous batching")
    _common_service_flags(p)
    p.add_argument("--model", help="HF causal LM directory or hub id")
    p.add_argument("--port", type=int, help="gRPC port (default: a free one)")
    p.add_argument("--host", help="address to bind (default 0.0.0.0)")
    p.add_argument(
        "--advertise-address",
        help="HOST:PORT schedulers dial (default: POD_IP, else this host's first non-loopback IP, and the port)",
    )
    p.add_argument("--executor-id", help="stable id for this executor (default: random)")
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--dtype", help="float32, float16 or bfloat16 (default float32)")
    p.add_argument("--kv-cache-memory-mb", type=int, help="memory for the paged KV cache, MiB")
    p.add_argument(
        "--backend",
        help="forward-pass backend: auto (default: the fastest that serves the model), cpu_native, "
        "cpu_transformers, cuda or torch (the reference); refused at start if it cannot serve the model",
    )
    p.set_defaults(func=_run_executor)


def _add_dev(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dev", help="run redis-server, a scheduler and an executor locally in one command")
    p.add_argument("--model", help="model dir or hub id (default: generate the tiny model)")
    p.add_argument("--port", type=int, default=50051, help="public gRPC port (default 50051)")
    p.add_argument("--redis-url", help="use this Redis instead of starting redis-server")
    p.add_argument("--workdir", default=".baton-dev", help="where the generated model and Redis files live")
    p.add_argument("--config", help="YAML config passed to both services")
    p.add_argument(
        "--executors",
        type=int,
        default=1,
        help="executor processes, each with its own copy of the model (default 1; docs/deployment.md says "
        "when more than one pays on a CPU host)",
    )
    p.set_defaults(func=lambda a: __import__("baton.dev", fromlist=["run"]).run(a))


def _add_clients(sub: argparse._SubParsersAction) -> None:
    from baton import client_commands

    p = sub.add_parser("generate", help="stream a completion to the terminal")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--target", default="127.0.0.1:50051", help="scheduler HOST:PORT (default 127.0.0.1:50051)")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--priority", type=int, default=5, help="0-10, higher runs sooner (default 5)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--tenant", default="", help="tenant to account the request to")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    client_commands.add_connection_flags(p)
    p.set_defaults(func=client_commands.generate)

    p = sub.add_parser("health", help="exit 0 when a service's gRPC health check reports SERVING")
    p.add_argument("--target", default="127.0.0.1:50051", help="service HOST:PORT (default 127.0.0.1:50051)")
    p.add_argument("--service", default="", help="service name to check (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer (default 3)")
    client_commands.add_connection_flags(p)
    p.set_defaults(func=client_commands.health)

    p = sub.add_parser("inspect", help="show queues, executors with their load, and requests by state")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis URL")
    p.add_argument("--prefix", default="baton", help="Redis key prefix (default baton)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--top", type=int, default=10, help="how many queued requests to list (default 10)")
    p.add_argument("--watch", action="store_true", help="keep refreshing a live view with throughput; Ctrl-C stops")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between --watch refreshes (default 1.0)")
    p.add_argument("--iterations", type=int, default=0, help="stop --watch after N refreshes (default 0: forever)")
    p.set_defaults(func=client_commands.inspect)


def _add_gateway(sub: argparse._SubParsersAction) -> None:
    from gateway import server as gateway_server

    p = sub.add_parser("gateway", help="serve an OpenAI-compatible HTTP API in front of a scheduler")
    gateway_server.add_arguments(p)
    p.set_defaults(func=gateway_server.run)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from baton.bench import cli as bench_cli

    p = sub.add_parser("bench", help="benchmark a scheduler: scenario presets, or `bench serve` (as vllm bench serve)")
    bench_cli.add_arguments(p)


def _service_config(args: argparse.Namespace, section: str, keys: dict[str, str]) -> object:
    from common.config_loading import load_config, with_overrides

    config = load_config(args.config)
    overrides = {field: getattr(args, flag) for flag, field in keys.items()}
    metrics_key = "metrics_port" if section == "scheduler" else "executor_metrics_port"
    return with_overrides(
        config,
        **{section: overrides},
        distributed={"redis_url": args.redis_url},
        monitoring={"log_level": args.log_level, metrics_key: args.metrics_port},
    )


def _run_scheduler(args: argparse.Namespace) -> int:
    from common import event_loop
    from common.service import setup_logging
    from scheduler_service.server import serve

    config = _service_config(args, "scheduler", {"port": "port", "host": "host", "tokenizer": "tokenizer"})
    setup_logging(config.monitoring.log_level)  # type: ignore[attr-defined]
    event_loop.run(serve(config))  # type: ignore[arg-type]
    return 0


def _run_executor(args: argparse.Namespace) -> int:
    from executor_service.cpu_threads import prefer_brief_openmp_spin

    prefer_brief_openmp_spin()  # before anything loads torch: libgomp reads it once
    from common import event_loop
    from common.service import setup_logging
    from executor_service.cpu_priority import lower_cpu_priority
    from executor_service.server import serve

    flags = [
        "model",
        "port",
        "host",
        "advertise_address",
        "executor_id",
        "device",
        "dtype",
        "kv_cache_memory_mb",
        "backend",
    ]
    config = _service_config(args, "executor", {f: f for f in flags})
    setup_logging(config.monitoring.log_level)  # type: ignore[attr-defined]
    lower_cpu_priority(config.executor.nice)  # type: ignore[attr-defined]  # before serve starts thread pools
    return event_loop.run(serve(config))  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Baton: LLM serving with a Redis-backed scheduler")
    sub = parser.add_subparsers(dest="command", required=True)
    mm = sub.add_parser("make-model", help="generate a random model (Llama, or --arch) and tokenizer, offline")
    make_model.add_arguments(mm)
    mm.set_defaults(func=make_model.run)
    _add_scheduler(sub)
    _add_executor(sub)
    _add_dev(sub)
    _add_clients(sub)
    _add_gateway(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A crash inside a C extension (grpc, torch, hiredis) then leaves every thread's Python stack
    # in the service's log instead of a silent exit (where stderr is a real file).
    with contextlib.suppress(ValueError, OSError, AttributeError):
        faulthandler.enable()
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or 0)
    except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:  # bad input: its message
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
