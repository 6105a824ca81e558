"""SIMULATED executors, for scheduler benchmarks only: no model, steps that take a fixed time.

Each one speaks the real internal protocol (proto/baton/v1/executor.proto ``Run`` and ``Info``),
serves grpc.health.v1, and registers and heartbeats in Redis with the real
``executor_service.registration.Registration``, so a scheduler cannot tell it from an executor. It
follows the engine's rules (``bench/sim_engine.py``: plan deltas at iteration boundaries, one
token per decode per step, the token budget, bounded batch and KV blocks). A step with work takes
``step_s`` on average (default 25 ms, 40 steps/s; paced by deadline); an idle one waits for a plan.

This is not a stand-in for the engine in tests: it exists to measure what one scheduler process can
drive (``bench/scheduler_scale.py``). Run many in one process, from the repository root:
``python -m bench.sim_executor --count 50 --redis-url redis://127.0.0.1:6379/0``; it prints a stats
JSON line every ``--stats-every`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypedDict

import grpc

from bench.sim_engine import SimConfig, SimEngine, SimStats
from common import service
from common.config import SecurityConfig
from common.health import add_health_and_reflection, set_serving
from common.keys import KeySchema
from common.pb import executor_pb2 as pb
from common.pb import executor_pb2_grpc
from common.redis_client import connect
from executor_service.registration import Registration

log = logging.getLogger("sim_executor")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name
_IDLE_WAIT_S = 0.05


class SimServicer(executor_pb2_grpc.ExecutorServicer):
    """One simulated executor: a step loop task, and the Run stream that carries plans and reports."""

    def __init__(self, executor_id: str, config: SimConfig) -> None:
        self.executor_id = executor_id
        self.config = config
        self.engine = SimEngine(config)
        self.stats = SimStats()
        self._inbox: asyncio.Queue[pb.Plan] = asyncio.Queue()
        self._subscriber: asyncio.Queue[pb.StepReport | None] | None = None
        self._sent_at: dict[int, float] = {}  # iteration -> when its report went out
        self._loop_task: asyncio.Task[None] | None = None

    def info(self) -> pb.InfoResponse:
        c = self.config
        return pb.InfoResponse(
            executor_id=self.executor_id,
            model="sim",
            max_model_len=c.max_model_len,
            kv_blocks_total=c.kv_blocks_total,
            block_size=c.block_size,
            dtype="sim",
            device="sim",
            max_batch_size=c.max_batch_size,
            token_budget=c.token_budget,
            eos_token_ids=[2],
            vocab_size=c.vocab_size,
        )

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return self.info()

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._step_loop(), name=f"sim-{self.executor_id}")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    # ---- the step loop (the engine thread of a real executor) -----------------------------
    def _apply_pending(self) -> None:
        while not self._inbox.empty():
            self.engine.apply(self._inbox.get_nowait())

    async def _step_loop(self) -> None:
        engine = self.engine
        step_s = self.config.step_s
        deadline = 0.0  # when the current step ends
        stepping = False  # the previous iteration ran a step, and this one follows it at once
        while True:
            if not engine.has_work and not engine.has_news:
                stepping = False
                with contextlib.suppress(TimeoutError):
                    plan = await asyncio.wait_for(self._inbox.get(), _IDLE_WAIT_S)
                    engine.apply(plan)
            self._apply_pending()
            if engine.has_work:
                started = time.perf_counter()
                # Back-to-back steps are paced by deadline: a sleep that woke late (this process
                # runs many simulators on one event loop) shortens the next step, though never
                # below half of step_s, so steps average step_s while wakes are under half a step
                # late (lateness beyond that is not made up). Paced by sleep alone they
                # averaged 25.9 ms at 10 simulators and 26.5 ms at 50: the simulators' own
                # lateness, counted against the scheduler.
                deadline = max(deadline + step_s, started + step_s / 2) if stepping else started + step_s
                report = engine.step(int(step_s * 1e9))
                await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
                stepping = True
                self.stats.steps += 1
                self.stats.tokens += len(report.tokens)
                self.stats.finished += len(report.finished)
                self.stats.busy_s += time.perf_counter() - started
                self._publish(report)
            elif engine.has_news:
                stepping = False
                self._publish(engine.drain())

    def _publish(self, report: pb.StepReport) -> None:
        self.stats.rejected += len(report.rejected)
        if self._subscriber is not None:
            self._sent_at[report.iteration] = time.perf_counter()
            self._sent_at.pop(report.iteration - 4096, None)  # a lagging scheduler still gets a figure
            self._subscriber.put_nowait(report)
            self.stats.reports += 1

    # ---- the Run stream ------------------------------------------------------------------
    async def Run(
        self, request_iterator: AsyncIterator[pb.Plan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepReport]:
        if self._subscriber is not None:
            self._subscriber.put_nowait(None)  # a new driver supersedes the old stream
        queue: asyncio.Queue[pb.StepReport | None] = asyncio.Queue()
        self._subscriber = queue
        reader = asyncio.create_task(self._read_plans(request_iterator, queue))
        try:
            while (report := await queue.get()) is not None:
                yield report
        finally:
            reader.cancel()
            if self._subscriber is queue:
                self._subscriber = None
                self.engine.abort_all()  # nobody drives it: the next driver re-queues its requests

    async def _read_plans(self, plans: AsyncIterator[pb.Plan], queue: asyncio.Queue[pb.StepReport | None]) -> None:
        try:
            async for plan in plans:
                now = time.perf_counter()
                sent = self._sent_at.get(plan.iteration - 1)
                if sent is not None:
                    self.stats.plan_latency_s.append(now - sent)
                self.stats.plans += 1
                self.stats.admitted += len(plan.admit)
                self._inbox.put_nowait(plan)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError, RuntimeError):
            pass
        finally:
            queue.put_nowait(None)


@dataclass
class RunningSim:
    servicer: SimServicer
    server: grpc.aio.Server
    registration: Registration
    port: int

    async def stop(self) -> None:
        await self.registration.stop()
        await self.server.stop(0.5)
        await self.servicer.stop()


async def start_sim(executor_id: str, redis_url: str, config: SimConfig, prefix: str = "baton") -> RunningSim:
    """Bind a free loopback port, serve Executor + health, register in Redis, start stepping."""
    servicer = SimServicer(executor_id, config)
    server = service.make_server(64 * 1024 * 1024)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = service.add_port(server, "127.0.0.1:0", SecurityConfig())
    await server.start()
    info = servicer.info()

    def load() -> dict[str, object]:
        return {"num_running": len(servicer.engine.running), "kv_blocks_total": info.kv_blocks_total}

    registration = Registration(
        connect(redis_url),
        KeySchema(prefix),
        executor_id,
        {
            "address": f"127.0.0.1:{port}",
            "model": info.model,
            "max_model_len": info.max_model_len,
            "vocab_size": info.vocab_size,
            "kv_blocks_total": info.kv_blocks_total,
            "block_size": info.block_size,
            "max_batch_size": info.max_batch_size,
            "device": info.device,
            "dtype": info.dtype,
            "started_ms": int(time.time() * 1000),
        },
        load,
        config.heartbeat_ms,
        config.timeout_ms,
    )
    servicer.start()
    await registration.start()
    await set_serving(health, [SERVICE_NAME], serving=True)
    return RunningSim(servicer, server, registration, port)


class Snapshot(TypedDict):
    """One stats line: ``SimStats`` summed over the sims, as JSON prints it."""

    time: float
    count: int
    steps: int
    tokens: int
    reports: int
    plans: int
    admitted: int
    rejected: int
    finished: int
    busy_s: float
    plan_latency_s: list[float]
    running: int


def snapshot(sims: list[RunningSim]) -> Snapshot:
    """Totals over all sims, and the plan latencies recorded since the last snapshot (then cleared)."""
    now = time.time()
    stats = [s.servicer.stats for s in sims]
    latencies: list[float] = []
    for s in sims:
        latencies += s.servicer.stats.plan_latency_s
        s.servicer.stats.plan_latency_s = []
    return Snapshot(
        time=now,
        count=len(sims),
        steps=sum(st.steps for st in stats),
        tokens=sum(st.tokens for st in stats),
        reports=sum(st.reports for st in stats),
        plans=sum(st.plans for st in stats),
        admitted=sum(st.admitted for st in stats),
        rejected=sum(st.rejected for st in stats),
        finished=sum(st.finished for st in stats),
        busy_s=sum(st.busy_s for st in stats),
        plan_latency_s=[round(x, 6) for x in latencies],
        running=sum(len(s.servicer.engine.running) for s in sims),
    )


async def serve(args: argparse.Namespace) -> None:
    config = SimConfig(step_s=args.step_ms / 1000, max_batch_size=args.max_batch_size, token_budget=args.token_budget)
    sims = [await start_sim(f"sim-{i:03d}", args.redis_url, config, args.prefix) for i in range(args.count)]
    log.info("%d simulated executors up (ports %d..)", len(sims), sims[0].port)
    stop = asyncio.Event()
    service.install_signal_handlers(stop)
    print(json.dumps({"ready": len(sims)}), flush=True)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.stats_every)
        print(json.dumps(snapshot(sims)), flush=True)
    await asyncio.gather(*(s.stop() for s in sims))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10, help="simulated executors in this process")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", default="baton", help="Redis key prefix (default baton)")
    parser.add_argument("--step-ms", type=float, default=25.0, help="time one step with work takes (default 25)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="most requests each runs at once (default 32)")
    parser.add_argument("--token-budget", type=int, default=512, help="tokens per step (default 512)")
    parser.add_argument("--stats-every", type=float, default=1.0, help="seconds between stats lines (default 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
