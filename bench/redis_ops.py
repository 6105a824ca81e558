"""Redis operations per generated token, with and without token-stream batching.

One workload (default: 32 concurrent greedy requests, prompts of 16-64 random ids, 96 output
tokens each, EOS ignored) runs once per stream interval against a fresh redis-server, with an
in-process executor and scheduler on the generated tiny model. For each run, after a warm-up
request, Redis's statistics are reset and the workload's commands are counted two ways:

- **commands**: every command Redis executed (``INFO commandstats``), commands that Baton's Lua
  scripts run inside Redis included: the server's work;
- **round trips**: commands clients sent (``MONITOR``, less the lines Redis marks as run by Lua):
  what the network and the event loop carry.

Both are divided by the tokens the clients received. Heartbeats, lease renewals and planning
ticks are counted too: they are part of the cost, and they shrink per token as the load grows.

    python -m bench.redis_ops                       # intervals 1 and 8
    python -m bench.redis_ops --intervals 1 4 16 --json ops.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import redis

from baton.dev import start_redis, stop_processes
from common.config import BatonConfig
from common.config_loading import with_overrides
from common.pb import generate_pb2 as pb
from common.pb.generate_pb2_grpc import GenerationStub

BOS = 1


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: int


@dataclass(frozen=True)
class PhaseResult:
    interval_tokens: int
    interval_ms: int
    tokens: int  # tokens the clients received
    commands: int  # everything Redis executed, script internals included
    round_trips: int  # commands clients sent
    stream_entries: int  # XADDs: one per stream event
    seconds: float
    by_command: dict[str, int]
    outputs: list[list[int]]

    @property
    def commands_per_token(self) -> float:
        return self.commands / max(1, self.tokens)

    @property
    def round_trips_per_token(self) -> float:
        return self.round_trips / max(1, self.tokens)


def make_workload(count: int, max_tokens: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[BOS] + [rng.randrange(5, 8000) for _ in range(rng.randint(15, 63))] for _ in range(count)]
    return Workload(prompts, max_tokens)


def _commandstats(client: redis.Redis) -> Counter[str]:
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})


async def _stream(stub: GenerationStub, prompt: list[int], max_tokens: int) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens: list[int] = []
    async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, params=params)):
        tokens.extend(chunk.token_ids)
    return tokens


async def run_phase(
    redis_url: str, model_dir: Path, workload: Workload, interval_tokens: int, interval_ms: int, workdir: Path
) -> PhaseResult:
    import grpc

    from executor_service.server import start_executor
    from scheduler_service.server import start_scheduler

    config = with_overrides(
        BatonConfig(),
        distributed={
            "redis_url": redis_url,
            "stream_interval_tokens": interval_tokens,
            "stream_interval_ms": interval_ms,
        },
        executor={"model": str(model_dir), "host": "127.0.0.1", "port": 0, "kv_cache_memory_mb": 256},
        scheduler={"host": "127.0.0.1", "port": 0},
    )
    config = dataclasses.replace(config, executor=dataclasses.replace(config.executor, executor_id="exec-0"))
    executor = await start_executor(config)
    scheduler = await start_scheduler(config)
    direct = redis.Redis.from_url(redis_url, decode_responses=True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}")
    monitor: subprocess.Popen[bytes] | None = None
    try:
        while not any(link.ready for link in scheduler.dispatcher.links.values()):
            await asyncio.sleep(0.05)
        stub = GenerationStub(channel)
        await _stream(stub, [BOS, 5, 6, 7], 4)  # warm-up, not counted
        direct.config_resetstat()
        log = workdir / f"monitor-{interval_tokens}-{interval_ms}.log"
        port = direct.connection_pool.connection_kwargs["port"]
        with open(log, "wb") as out:  # line-buffered, so stopping it loses no line
            monitor = subprocess.Popen(["stdbuf", "-oL", "redis-cli", "-p", str(port), "monitor"], stdout=out)
        await asyncio.sleep(0.3)  # MONITOR attached before the first request
        started = time.perf_counter()
        outputs = await asyncio.gather(*(_stream(stub, p, workload.max_tokens) for p in workload.prompts))
        seconds = time.perf_counter() - started
        await asyncio.sleep(0.3)  # let MONITOR write out the tail
        stop_processes([monitor])
        monitor = None
        stats = _commandstats(direct)
    finally:
        if monitor is not None:
            stop_processes([monitor])
        await channel.close()
        await scheduler.stop(grace=0.5)
        await executor.stop(grace=0.5)
    lines = log.read_text(errors="replace").splitlines()
    round_trips = sum(1 for line in lines if " [" in line and " lua]" not in line)
    for noise in ("config|resetstat", "info", "monitor", "flushall"):
        stats.pop(noise, None)
    direct.flushall()
    direct.close()
    return PhaseResult(
        interval_tokens,
        interval_ms,
        tokens=sum(len(o) for o in outputs),
        commands=sum(stats.values()),
        round_trips=round_trips,
        stream_entries=stats.get("xadd", 0),
        seconds=seconds,
        by_command=dict(stats.most_common()),
        outputs=outputs,
    )


async def measure(
    model_dir: Path, workload: Workload, phases: list[tuple[int, int]], workdir: Path
) -> list[PhaseResult]:
    """Run the workload once per (interval tokens, interval ms) on one fresh redis-server."""
    redis_proc, redis_url = start_redis(workdir)
    try:
        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()
        return [await run_phase(redis_url, model_dir, workload, n, ms, workdir) for n, ms in phases]
    finally:
        stop_processes([redis_proc])


def report(results: list[PhaseResult]) -> str:
    base = results[0]
    rows = [
        f"{'interval':>9} {'tokens':>7} {'entries':>8} {'commands':>9} {'cmd/token':>10} {'trips/token':>12} "
        f"{'vs first':>9}  top commands"
    ]
    for r in results:
        top = ", ".join(f"{name} {count}" for name, count in list(r.by_command.items())[:5])
        label = f"{r.interval_tokens}" + (f"/{r.interval_ms}ms" if r.interval_ms else "")
        ratio = base.commands_per_token / max(r.commands_per_token, 1e-9)
        rows.append(
            f"{label:>9} {r.tokens:>7} {r.stream_entries:>8} {r.commands:>9} {r.commands_per_token:>10.2f} "
            f"{r.round_trips_per_token:>12.2f} {ratio:>8.2f}x  {top}"
        )
    same = all(r.outputs == base.outputs for r in results)
    rows.append(f"every interval streamed the same tokens: {'yes' if same else 'NO'}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 8], help="stream intervals in tokens")
    parser.add_argument("--interval-ms", type=int, default=0, help="stream_interval_ms for the batched runs")
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests (default 32)")
    parser.add_argument("--max-tokens", type=int, default=96, help="output tokens per request (default 96)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    parser.add_argument("--model", type=Path, help="model directory (default: generate the tiny model)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    workload = make_workload(args.requests, args.max_tokens, args.seed)
    with tempfile.TemporaryDirectory(prefix="baton-redis-ops-") as tmp:
        workdir = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            from baton.make_model import make_model

            model_dir = make_model(workdir / "tiny", size="tiny", seed=0)
        phases = [(n, 0 if n == 1 else args.interval_ms) for n in args.intervals]
        results = asyncio.run(measure(model_dir, workload, phases, workdir))
    print(report(results))
    if args.json:
        rows = [{**dataclasses.asdict(r), "outputs": None} for r in results]
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r.outputs == results[0].outputs for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
