"""How many executors can one scheduler process drive? Simulated executors at 40 steps/s each.

For each count (default 10, 50, 100): a fresh redis-server, N simulated executors in one process
(``bench/sim_executor.py``, each its own gRPC server), and ONE ``baton scheduler`` process. A client
keeps every executor's batch full through the public API (``Complete`` calls, with a quarter more
in flight than the executors hold, so the queue never runs dry). After a warm-up, over a window:

- **executor steps/s**: steps the simulated executors ran (they step only while they have work);
- **scheduler steps/s**: step reports the scheduler consumed (``baton:step_time_seconds`` count);
- **ratio**: the lower of the two over the rate the executors could step at (executors / step time):
  1.0 means the scheduler never held an executor back;
- **busy**: the share of time executors had work; **batch**: mean tokens per step / max batch;
- **plan p50/p99**: at the executors, from sending step report k to receiving the plan made for
  iteration k+1 (the scheduler saw report k first): report handling, Redis writes, placement, claims;
- **plan_once p99**: the scheduler's own ``baton:plan_latency_seconds`` (admission pass), from its histogram;
- **CPU ms/plan**: scheduler CPU seconds over plans the executors received, in ms; also the scheduler's,
  the simulators' and Redis's CPU use in cores (2 cores on the reference machine: they compete).

The scheduler also serves the client's requests (reads their Redis streams), as a replica does.
Run from the repository root: ``python -m bench.scheduler_scale --counts 10 50`` (``--help`` for the flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil

from baton.bench.client import wait_until_serving
from baton.bench.local_stack import ensure_model
from baton.bench.stats import percentile
from baton.dev import free_port, start_redis, stop_processes, wait_healthy
from common.pb import generate_pb2 as pb
from common.pb.generate_pb2_grpc import GenerationStub

ROOT = Path(__file__).resolve().parent.parent  # the simulators and the scheduler run from here, as modules


def say(message: str) -> None:
    print(f"[scheduler-scale] {message}", file=sys.stderr, flush=True)


@dataclass
class ScaleResult:
    executors: int
    target_steps_s: float
    executor_steps_s: float
    scheduler_steps_s: float
    ratio: float
    busy: float
    batch_fill: float
    plan_p50_ms: float
    plan_p99_ms: float
    plan_once_p99_ms: float
    cpu_ms_per_plan: float
    plans_s: float
    scheduler_cores: float
    sim_cores: float
    redis_cores: float
    requests_done: int
    failed: int


# ---- the simulators' stats lines -------------------------------------------------------------
class SimProcess:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def next(self, timeout_s: float = 60) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"no stats from the simulators in {timeout_s:.0f} s (exit {self.proc.poll()})") from None


# ---- the scheduler's metrics -------------------------------------------------------------------
_SAMPLE = re.compile(r"^(baton:[a-z_]+)(?:\{([^}]*)\})? ([0-9.e+-]+|\+Inf|NaN)$")


def scrape(port: int) -> dict[str, Any]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    steps, buckets = 0.0, {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "baton:step_time_seconds_count":
            steps += value
        elif name == "baton:plan_latency_seconds_bucket":
            le = re.search(r'le="([^"]+)"', labels)
            if le:
                buckets[float(le.group(1))] = value
    return {"steps": steps, "plan_buckets": buckets}


def histogram_p99(before: dict[float, float], after: dict[float, float]) -> float:
    """p99 of the observations between two scrapes, interpolated linearly inside its bucket (seconds)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return float("nan")
    rank, low, prev = 0.99 * total, 0.0, 0.0
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            if bound == float("inf"):
                return low
            return low + (bound - low) * (rank - prev) / max(cumulative - prev, 1e-9)
        low, prev = bound, cumulative
    return low


# ---- load ----------------------------------------------------------------------------------------
@dataclass
class Feeder:
    done: int = 0
    failed: int = 0
    stop: bool = False


async def feed(target: str, in_flight: int, prompt_len: int, output_len: int, feeder: Feeder) -> None:
    """Keep ``in_flight`` Complete calls going until ``feeder.stop``."""
    # Each channel its own connection (a local subchannel pool): channels to one target otherwise
    # share a single HTTP/2 connection, whose concurrent-stream limit then caps the load.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(max(1, in_flight // 50))]
    prompt = [1] + [5 + i % 7000 for i in range(prompt_len - 1)]
    params = pb.SamplingParams(max_tokens=output_len, ignore_eos=True)

    async def loop(i: int) -> None:
        stub = GenerationStub(channels[i % len(channels)])
        while not feeder.stop:
            try:
                reply = await stub.Complete(pb.GenerateRequest(prompt_token_ids=prompt, params=params), timeout=120)
                feeder.done += 1
                if len(reply.token_ids) != output_len:
                    feeder.failed += 1
            except grpc.aio.AioRpcError as exc:
                feeder.failed += 1
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    await asyncio.sleep(0.2)

    try:
        await asyncio.gather(*(loop(i) for i in range(in_flight)))
    finally:
        for channel in channels:
            await channel.close()


def cpu(pid: int) -> float:
    return sum(psutil.Process(pid).cpu_times()[:2])


async def measure(
    count: int, args: argparse.Namespace, sims: SimProcess, pids: dict[str, int], metrics_port: int, target: str
) -> ScaleResult:
    async with grpc.aio.insecure_channel(target) as channel:
        await wait_until_serving(GenerationStub(channel))  # the scheduler loads its tokenizer on first use
    feeder = Feeder()
    in_flight = int(count * args.max_batch_size * 1.25) + 1
    task = asyncio.create_task(feed(target, in_flight, args.prompt_len, args.output_len, feeder))
    try:
        await asyncio.sleep(args.warmup)
        await asyncio.to_thread(_drain, sims)
        first = await asyncio.to_thread(sims.next)
        cpu0 = {k: cpu(p) for k, p in pids.items()}
        m0 = await asyncio.to_thread(scrape, metrics_port)
        done0, failed0 = feeder.done, feeder.failed
        samples: list[float] = []
        last = first
        while last["time"] - first["time"] < args.window:
            last = await asyncio.to_thread(sims.next)
            samples += last["plan_latency_s"]
        m1 = await asyncio.to_thread(scrape, metrics_port)
        cpu1 = {k: cpu(p) for k, p in pids.items()}
        done, failed = feeder.done - done0, feeder.failed - failed0
    finally:
        feeder.stop = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    dt = last["time"] - first["time"]
    target_rate = count / (args.step_ms / 1000)
    ex_steps = (last["steps"] - first["steps"]) / dt
    sched_steps = (m1["steps"] - m0["steps"]) / dt
    plans = last["plans"] - first["plans"]
    steps = max(1, last["steps"] - first["steps"])
    sched_cpu = cpu1["scheduler"] - cpu0["scheduler"]
    return ScaleResult(
        executors=count,
        target_steps_s=target_rate,
        executor_steps_s=ex_steps,
        scheduler_steps_s=sched_steps,
        ratio=min(ex_steps, sched_steps) / target_rate,
        busy=(last["busy_s"] - first["busy_s"]) / (count * dt),
        batch_fill=(last["tokens"] - first["tokens"]) / steps / args.max_batch_size,
        plan_p50_ms=percentile(samples, 50) * 1000,
        plan_p99_ms=percentile(samples, 99) * 1000,
        plan_once_p99_ms=histogram_p99(m0["plan_buckets"], m1["plan_buckets"]) * 1000,
        cpu_ms_per_plan=sched_cpu / max(1, plans) * 1000,
        plans_s=plans / dt,
        scheduler_cores=sched_cpu / dt,
        sim_cores=(cpu1["sims"] - cpu0["sims"]) / dt,
        redis_cores=(cpu1["redis"] - cpu0["redis"]) / dt,
        requests_done=done,
        failed=failed,
    )


def _drain(sims: SimProcess) -> None:
    while True:
        try:
            sims.lines.get_nowait()
        except queue.Empty:
            return


def run_count(count: int, args: argparse.Namespace, tokenizer_dir: Path, logs: Path) -> ScaleResult:
    procs: list[subprocess.Popen[Any]] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", BATON_SCHEDULER__BATCH_LEVEL__MAX_BATCH_SIZE=str(args.max_batch_size))
    with tempfile.TemporaryDirectory(prefix="redis-", dir=logs) as redis_dir:
        try:
            redis_proc, redis_url = start_redis(Path(redis_dir))
            procs.append(redis_proc)
            sim_cmd = [sys.executable, "-m", "bench.sim_executor", "--count", str(count), "--redis-url", redis_url]
            sim_cmd += ["--step-ms", str(args.step_ms), "--max-batch-size", str(args.max_batch_size)]
            with open(logs / f"sims-{count}.log", "w") as sim_log:
                sim_proc = subprocess.Popen(
                    sim_cmd, stdout=subprocess.PIPE, stderr=sim_log, text=True, env=env, cwd=ROOT
                )
            procs.append(sim_proc)
            sims = SimProcess(sim_proc)
            ready = sims.next(120)
            say(f"{ready.get('ready')} simulated executors up")
            port, metrics_port = free_port(), free_port()
            cmd = [sys.executable, "-m", "baton.cli", "scheduler", "--redis-url", redis_url, "--host", "127.0.0.1"]
            cmd += ["--port", str(port), "--metrics-port", str(metrics_port), "--tokenizer", str(tokenizer_dir)]
            cmd += ["--log-level", "WARNING"]
            with open(logs / f"scheduler-{count}.log", "wb") as sched_log:
                sched = subprocess.Popen(cmd, stdout=sched_log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            procs.append(sched)
            wait_healthy(f"127.0.0.1:{port}", sched, 60)
            pids = {"redis": redis_proc.pid, "sims": sim_proc.pid, "scheduler": sched.pid}
            return asyncio.run(measure(count, args, sims, pids, metrics_port, f"127.0.0.1:{port}"))
        finally:
            stop_processes(procs)


def print_table(results: list[ScaleResult], args: argparse.Namespace) -> None:
    print(
        f"\nsimulated executors: step {args.step_ms:g} ms, max batch {args.max_batch_size}, prompt {args.prompt_len}, "
        f"output {args.output_len}; window {args.window:g} s; {os.cpu_count()} CPUs"
    )
    head = ["execs", "target st/s", "exec st/s", "sched st/s", "ratio", "busy", "batch", "plan p50 ms"]
    head += ["plan p99 ms", "plan_once p99", "CPU ms/plan", "plans/s", "sched cores", "sim cores", "redis cores", "req"]
    print(" ".join(f"{h:>12}" for h in head))
    for r in results:
        cells = [r.executors, r.target_steps_s, r.executor_steps_s, r.scheduler_steps_s, r.ratio, r.busy, r.batch_fill]
        cells += [r.plan_p50_ms, r.plan_p99_ms, r.plan_once_p99_ms, r.cpu_ms_per_plan, r.plans_s]
        cells += [r.scheduler_cores, r.sim_cores, r.redis_cores, r.requests_done]
        print(" ".join(f"{c:>12}" if isinstance(c, int) else f"{c:>12.2f}" for c in cells))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--counts", nargs="+", type=int, default=[10, 50, 100], help="executor counts (default 10 50 100)"
    )
    parser.add_argument("--step-ms", type=float, default=25.0, help="simulated step time (default 25 = 40 steps/s)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests per executor (default 16)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before the window (default 5)")
    parser.add_argument("--window", type=float, default=15.0, help="measured seconds (default 15)")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "baton-bench"))
    parser.add_argument("--json", help="also write the results here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir).resolve()
    logs = workdir / "logs-scale"
    logs.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = ensure_model(workdir, "tiny")  # the scheduler needs a tokenizer; the sims have no model
    results = []
    for count in args.counts:
        say(f"== {count} simulated executors (logs in {logs})")
        result = run_count(count, args, tokenizer_dir, logs)
        say(f"{count}: ratio {result.ratio:.3f}, plan p99 {result.plan_p99_ms:.1f} ms")
        results.append(result)
    print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    med = statistics.median(r.ratio for r in results) if results else 0.0
    say(f"median ratio over counts {med:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
