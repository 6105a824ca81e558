"""Admission cost against queue length: does choosing and claiming work stay flat from 1K to 100K?

For each size the bench fills a fresh redis-server's queue with that many pending requests
(spread over ``--tenants`` tenants, random priorities, through the real ENQUEUE script), then
times ``--rounds`` admission rounds. One round is what the dispatcher does per plan: read the
waiting tenants' queue heads in fair order (``Admission.candidates``) and claim the first
(``RequestRecords.claim``). It also times single enqueues. It prints p50/p99 per size and the
p99 ratio of the largest size to the smallest; flat means a ratio near 1.

    python -m bench.queue_scale --sizes 1000 10000 100000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from baton.dev import start_redis, stop_processes
from common.config import BatonConfig
from common.keys import KeySchema
from common.sampling_params import SamplingParams
from scheduler_service.admission import Admission
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.requests import NewRequest
from scheduler_service.scoring import RequestScorer
from scheduler_service.store import Store

PROMPT = tuple(range(1, 65))


def new_request(i: int, rng: random.Random, tenants: int, now: int) -> NewRequest:
    return NewRequest(
        request_id=f"r{i}",
        prompt_ids=PROMPT,
        params=SamplingParams(max_tokens=rng.randrange(16, 256)),
        priority=rng.randrange(0, 11),
        tenant=f"t{rng.randrange(tenants)}",
        deadline_ms=0,
        arrival_ms=now + i,
    )


async def fill(store: Store, scorer: RequestScorer, count: int, tenants: int, seed: int) -> None:
    rng = random.Random(seed)
    now = int(time.time() * 1000)
    batch = 100  # concurrent enqueues; the client pool caps open connections
    for start in range(0, count, batch):
        reqs = [new_request(i, rng, tenants, now) for i in range(start, min(count, start + batch))]
        await asyncio.gather(*(_enqueue(store, scorer, r, count) for r in reqs))


async def _enqueue(store: Store, scorer: RequestScorer, req: NewRequest, limit: int) -> None:
    scored = scorer.score(req)
    await store.requests.enqueue(req, scored.score, limit + 10_000, "", scored.fields)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(redis_url: str, size: int, args: argparse.Namespace) -> dict[str, float]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    await client.flushall()
    config = BatonConfig()
    store = Store(client, KeySchema(), 3600)
    scorer = RequestScorer(config)
    admission = Admission(store, config, scorer, SchedulerMetrics())
    started = time.perf_counter()
    await fill(store, scorer, size, args.tenants, args.seed)
    fill_s = time.perf_counter() - started
    rounds, enqueues = [], []
    rng = random.Random(args.seed + 1)
    for i in range(args.rounds):
        t0 = time.perf_counter()
        ordered = await admission.candidates(args.candidates)
        await store.requests.claim(ordered[0].request_id, "bench-executor")
        rounds.append(time.perf_counter() - t0)
        req = new_request(size + i, rng, args.tenants, int(time.time() * 1000))
        t0 = time.perf_counter()
        await _enqueue(store, scorer, req, size * 2)
        enqueues.append(time.perf_counter() - t0)
    await client.aclose()
    ms = 1000.0
    return {
        "size": size,
        "fill_s": fill_s,
        "admit_p50_ms": statistics.median(rounds) * ms,
        "admit_p99_ms": percentile(rounds, 0.99) * ms,
        "enqueue_p50_ms": statistics.median(enqueues) * ms,
        "enqueue_p99_ms": percentile(enqueues, 0.99) * ms,
    }


async def run(args: argparse.Namespace, redis_url: str) -> list[dict[str, float]]:
    return [await measure(redis_url, size, args) for size in args.sizes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000], help="queue lengths")
    parser.add_argument("--rounds", type=int, default=500, help="admission rounds timed per size")
    parser.add_argument("--tenants", type=int, default=8, help="tenants the queued requests belong to")
    parser.add_argument("--candidates", type=int, default=64, help="queue heads read per round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="baton-queue-scale-") as workdir:
        proc, redis_url = start_redis(Path(workdir))
        try:
            time.sleep(0.3)
            results = asyncio.run(run(args, redis_url))
        finally:
            stop_processes([proc])
    print(
        f"{'pending':>9} {'fill s':>7} {'admit p50 ms':>13} {'admit p99 ms':>13} {'enq p50 ms':>11} {'enq p99 ms':>11}"
    )
    for r in results:
        print(
            f"{int(r['size']):>9} {r['fill_s']:>7.1f} {r['admit_p50_ms']:>13.3f} {r['admit_p99_ms']:>13.3f}"
            f" {r['enqueue_p50_ms']:>11.3f} {r['enqueue_p99_ms']:>11.3f}"
        )
    first, last = results[0], results[-1]
    print(
        f"admission p99 ratio {int(last['size'])}/{int(first['size'])}: "
        f"{last['admit_p99_ms'] / first['admit_p99_ms']:.2f}; "
        f"enqueue p99 ratio: {last['enqueue_p99_ms'] / first['enqueue_p99_ms']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
