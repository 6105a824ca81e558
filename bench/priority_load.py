"""Adaptive scheduling under overload: TTFT by priority class, deadlines met, tenant fairness.

One run, on the generated tiny model, with redis-server, an executor and a scheduler as separate
processes (``baton.bench.local_stack``):

1. **Capacity.** A closed burst of requests measures how many requests a second the stack serves.
2. **Unloaded.** Each priority class runs alone, one request at a time: its TTFT p50/p99 baseline.
3. **Overload, on the same arrivals, alternately adaptive and FIFO** (``--pairs`` of each, one
   stack, so drift in the machine's load hits both alike). Poisson arrivals at ``--load`` (2x)
   times capacity for ``--seconds``: priorities 10/5/0 (20/30/50 %), tenants A/B (70/30 % of
   requests, so both ask for more than half the capacity), a third of the requests with a
   deadline. FIFO sends the same requests as one tenant with the default priority and no
   deadline, so the queue is in arrival order and nothing preempts.

It prints TTFT p50/p99 per class over the class's unloaded figure (the ratio), the share of
deadlines met, and tenant B's generated tokens over tenant A's while both had work waiting.

    python -m bench.priority_load --seconds 30 --markdown /tmp/priority_load.md
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from baton.bench.local_stack import ensure_model, local_stack
from common.pb import generate_pb2 as pb
from common.pb.generate_pb2_grpc import GenerationStub

CLASSES = (10, 5, 0)
CLASS_SHARE = (0.2, 0.3, 0.5)
TENANT_SHARE = {"A": 0.7, "B": 0.3}
# A batch of 8 makes capacity a hard limit that the overload really exceeds (with 64 slots the
# tiny model absorbs 2x a small burst's rate by batching more, and no queue forms).
STACK_ENV = {"BATON_SCHEDULER__BATCH_LEVEL__MAX_BATCH_SIZE": "8"}


@dataclass(frozen=True)
class Job:
    at_s: float  # arrival offset from the start
    prompt: list[int]
    max_tokens: int
    priority: int
    tenant: str
    deadline_s: float  # seconds after arrival; 0: none


@dataclass
class Outcome:
    job: Job
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    token_times: list[float] = field(default_factory=list)


def make_jobs(rate: float, seconds: float, seed: int, deadline_s: float) -> list[Job]:
    rng = random.Random(seed)
    jobs: list[Job] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            return jobs
        prompt = [1] + [rng.randrange(5, 8000) for _ in range(rng.randrange(16, 64))]
        priority = rng.choices(CLASSES, CLASS_SHARE)[0]
        tenant = rng.choices(list(TENANT_SHARE), list(TENANT_SHARE.values()))[0]
        deadline = deadline_s if rng.random() < 1 / 3 else 0.0
        jobs.append(Job(t, prompt, rng.randrange(16, 33), priority, tenant, deadline))


def to_request(job: Job, adaptive: bool) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(
        prompt_token_ids=job.prompt, params=pb.SamplingParams(max_tokens=job.max_tokens, ignore_eos=True)
    )
    if adaptive:
        msg.priority = job.priority
        msg.tenant = job.tenant
        if job.deadline_s:
            msg.deadline_ms = int((time.time() + job.deadline_s) * 1000)
    return msg


async def run_one(stub: GenerationStub, job: Job, adaptive: bool, origin: float) -> Outcome:
    out = Outcome(job)
    await asyncio.sleep(max(0.0, origin + job.at_s - time.perf_counter()))
    out.sent = time.perf_counter()
    async for chunk in stub.Generate(to_request(job, adaptive)):
        now = time.perf_counter()
        if chunk.token_ids and out.first is None:
            out.first = now
        out.token_times.extend([now] * len(chunk.token_ids))
    out.done = time.perf_counter()
    return out


async def run_jobs(target: str, jobs: list[Job], adaptive: bool) -> list[Outcome]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = GenerationStub(channel)
        await _warm(stub)
        origin = time.perf_counter()
        return list(await asyncio.gather(*(run_one(stub, j, adaptive, origin) for j in jobs)))


async def _warm(stub: GenerationStub) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            await stub.Complete(pb.GenerateRequest(prompt_token_ids=[1, 5, 6], params=pb.SamplingParams(max_tokens=2)))
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def capacity(target: str, seed: int, count: int) -> float:
    """Requests a second the stack serves on a closed burst of ``count`` of this workload's requests."""
    jobs = [Job(0.0, j.prompt, j.max_tokens, 5, "A", 0.0) for j in make_jobs(1.0, 3.0 * count, seed + 7, 0.0)[:count]]
    started = time.perf_counter()
    await run_jobs(target, jobs, adaptive=False)
    return len(jobs) / (time.perf_counter() - started)


async def unloaded(target: str, seed: int, per_class: int) -> dict[int, list[float]]:
    """TTFTs per class with each request alone (the same length distribution as the overload)."""
    ttft: dict[int, list[float]] = {c: [] for c in CLASSES}
    samples = make_jobs(1.0, 3.0 * per_class * len(CLASSES), seed + 11, 0.0)
    for i, cls in enumerate(CLASSES):
        for job in samples[i * per_class : (i + 1) * per_class]:
            (out,) = await run_jobs(target, [Job(0.0, job.prompt, job.max_tokens, cls, job.tenant, 0.0)], True)
            assert out.first is not None
            ttft[cls].append(out.first - out.sent)
    return ttft


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(outcomes: list[Outcome], base: dict[int, list[float]], seconds: float) -> dict[str, float]:
    row: dict[str, float] = {}
    for cls in CLASSES:
        ttft = [o.first - o.sent for o in outcomes if o.job.priority == cls and o.first is not None] or [float("nan")]
        row[f"p{cls}_p50"] = pct(ttft, 0.5) / statistics.median(base[cls])
        row[f"p{cls}_p99"] = pct(ttft, 0.99) / pct(base[cls], 0.99)
        row[f"p{cls}_p50_s"] = pct(ttft, 0.5)
        row[f"p{cls}_p99_s"] = pct(ttft, 0.99)
    with_deadline = [o for o in outcomes if o.job.deadline_s]
    met = [o for o in with_deadline if o.done is not None and o.done - o.sent <= o.job.deadline_s]
    row["deadlines_met"] = len(met) / max(1, len(with_deadline))
    # Tokens each tenant received while the arrivals lasted (both tenants had work waiting then).
    start = min(o.sent for o in outcomes)
    window = (start + 0.2 * seconds, start + seconds)
    tokens = {t: 0 for t in TENANT_SHARE}
    for o in outcomes:
        tokens[o.job.tenant] += sum(window[0] <= t <= window[1] for t in o.token_times)
    row["tenant_b_over_a"] = tokens["B"] / max(1, tokens["A"])
    ends = [o.done for o in outcomes if o.done is not None]
    row["tok_s"] = sum(len(o.token_times) for o in outcomes) / (max(ends) - start)
    return row


def report(rows: dict[str, dict[str, float]], cap: float, load: float, jobs: int, seconds: float) -> str:
    lines = [
        f"capacity {cap:.2f} req/s; arrivals {load:.1f}x = {cap * load:.2f} req/s"
        f" for {seconds:.0f} s ({jobs} requests)",
        "",
        "| scheduler | p10 TTFT p50 / p99 s (x unloaded) | p5 TTFT p50 / p99 s | p0 TTFT p50 / p99 s "
        "| deadlines met | tenant B/A tokens | output tok/s |",
        "| --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        cells = [
            f"{r[f'p{c}_p50_s']:.2f} / {r[f'p{c}_p99_s']:.2f} ({r[f'p{c}_p50']:.1f}x / {r[f'p{c}_p99']:.1f}x)"
            for c in CLASSES
        ]
        tail = f"{r['deadlines_met']:.0%} | {r['tenant_b_over_a']:.2f} | {r['tok_s']:.0f}"
        lines.append(f"| {name} | {' | '.join(cells)} | {tail} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long arrivals last in each overload run")
    parser.add_argument("--load", type=float, default=2.0, help="arrival rate as a multiple of measured capacity")
    parser.add_argument("--deadline", type=float, default=5.0, help="seconds from arrival to a request's deadline")
    parser.add_argument("--pairs", type=int, default=2, help="adaptive/FIFO runs, alternated")
    parser.add_argument("--capacity-requests", type=int, default=48, help="burst size that measures capacity")
    parser.add_argument("--unloaded-requests", type=int, default=8, help="requests per class run alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "baton-bench")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = ensure_model(args.workdir)
    rows: dict[str, dict[str, float]] = {}
    with local_stack(model, args.workdir / "priority-load-logs", overrides=STACK_ENV) as stack:
        cap = asyncio.run(capacity(stack.target, args.seed, args.capacity_requests))
        jobs = make_jobs(cap * args.load, args.seconds, args.seed, args.deadline)
        base = asyncio.run(unloaded(stack.target, args.seed, args.unloaded_requests))
        print(f"capacity {cap:.2f} req/s; {len(jobs)} arrivals per run", flush=True)
        # Alternate the two modes on one stack, so drift in the machine's load hits both alike.
        for i in range(args.pairs):
            for name, adaptive in (("Baton adaptive", True), ("FIFO", False)):
                print(f"run {i + 1}: {name}", flush=True)
                outcomes = asyncio.run(run_jobs(stack.target, jobs, adaptive))
                rows[f"{name} #{i + 1}"] = summarize(outcomes, base, args.seconds)
    table = report(rows, cap, args.load, len(jobs), args.seconds)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
