"""SIMULATED executors, for scheduler benchmarks only: no model, steps that take a fixed time.

Each one speaks the real internal protocol (proto/baton/v1/executor.proto ``Run`` and ``Info``),
serves grpc.health.v1, and registers and heartbeats in Redis with the real
``executor_service.registration.Registration``, so a scheduler cannot tell it from an executor. It
follows the engine's rules: plans apply at the next iteration boundary (admit, abort, preempt,
prefill grants, token budget); every running decode gets one token per step and prefill gets what
the budget leaves; a request that finishes its prefill emits its first token in that step; the batch
and the KV blocks are bounded, and a full batch rejects. A step with work takes ``step_s`` on
average (default 25 ms, 40 steps/s; paced by deadline); an idle one waits for a plan. Tokens are
made-up ids and never EOS.

This is not a stand-in for the engine in tests: it exists to measure what one scheduler process can
drive (``bench/scheduler_scale.py``). Run many in one process: ``python bench/sim_executor.py --count 50
--redis-url redis://127.0.0.1:6379/0``; it prints a stats JSON line every ``--stats-every`` seconds.
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
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import service
from common.config import SecurityConfig
from common.health import add_health_and_reflection, set_serving
from common.keys import KeySchema
from common.lifecycle import FinishReason
from common.pb import executor_pb2 as pb
from common.pb import executor_pb2_grpc
from common.redis_client import connect
from executor_service.registration import Registration

log = logging.getLogger("sim_executor")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name
_IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class SimConfig:
    """What a simulated executor claims to be, and how long its steps take."""

    step_s: float = 0.025
    max_batch_size: int = 32
    token_budget: int = 512
    kv_blocks_total: int = 8192
    block_size: int = 16
    max_model_len: int = 4096
    vocab_size: int = 8192
    heartbeat_ms: int = 500
    timeout_ms: int = 3000

    def __post_init__(self) -> None:
        if self.step_s <= 0:
            raise ValueError(f"step_s must be positive, got {self.step_s}")
        if self.max_batch_size < 1 or self.token_budget < 2:
            raise ValueError("max_batch_size must be >= 1 and token_budget >= 2")


@dataclass
class SimRequest:
    request_id: str
    num_tokens: int  # prompt + already generated (all to prefill)
    generated: int  # output tokens so far (resumed ones count)
    max_tokens: int
    rank: float
    computed: int = 0

    @property
    def decoding(self) -> bool:
        return self.computed >= self.num_tokens

    def blocks(self, block_size: int) -> int:
        return -(-(self.computed + 1) // block_size)


@dataclass
class SimStats:
    """Counters one executor keeps; the benchmark reads them."""

    steps: int = 0  # steps with work
    tokens: int = 0  # tokens emitted
    reports: int = 0  # StepReports handed to gRPC
    plans: int = 0  # Plans received
    admitted: int = 0
    rejected: int = 0
    finished: int = 0
    busy_s: float = 0.0  # time spent in steps with work
    plan_latency_s: list[float] = field(default_factory=list)  # report k sent -> plan for k+1 received


class SimEngine:
    """The engine's bookkeeping with a stopwatch for a model. Pure; no gRPC."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.running: dict[str, SimRequest] = {}
        self.iteration = 0
        self.plan_seq = 0
        self.token_budget = config.token_budget
        self._grants: dict[str, int] = {}
        self._finished: list[pb.FinishedRequest] = []
        self._preempted: list[str] = []
        self._rejected: list[pb.FinishedRequest] = []
        self._reported_seq = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    @property
    def has_news(self) -> bool:
        return bool(self._finished or self._preempted or self._rejected) or self.plan_seq != self._reported_seq

    def apply(self, plan: pb.Plan) -> None:
        for request_id in plan.abort:
            if self.running.pop(request_id, None) is not None:
                self._finished.append(pb.FinishedRequest(request_id=request_id, finish_reason=FinishReason.CANCELLED))
        for request_id in plan.preempt:
            if self.running.pop(request_id, None) is not None:
                self._preempted.append(request_id)
        for admit in plan.admit:
            self._admit(admit)
        self._grants = {g.request_id: g.num_tokens for g in plan.prefill}
        if plan.token_budget > 0:
            self.token_budget = plan.token_budget
        self.plan_seq = plan.seq

    def abort_all(self) -> None:
        self.running.clear()

    def _admit(self, admit: pb.AdmitRequest) -> None:
        self.running.pop(admit.request_id, None)  # a re-admission restarts it
        total = len(admit.prompt_token_ids) + len(admit.output_token_ids)
        blocks = -(-(total + 1) // self.config.block_size)
        if total >= self.config.max_model_len or blocks > self.config.kv_blocks_total:
            error = f"{total} tokens do not fit"
            self._finished.append(pb.FinishedRequest(request_id=admit.request_id, finish_reason=4, error=error))
            return
        if len(self.running) >= min(self.config.max_batch_size, self.token_budget - 1):
            self._rejected.append(pb.FinishedRequest(request_id=admit.request_id, error="batch full"))
            return
        max_tokens = max(1, admit.sampling.max_tokens)
        req = SimRequest(admit.request_id, total, len(admit.output_token_ids), max_tokens, admit.rank)
        self.running[admit.request_id] = req
        if req.generated >= max_tokens:
            self._finish(req)

    def _finish(self, req: SimRequest) -> None:
        self.running.pop(req.request_id, None)
        self._finished.append(pb.FinishedRequest(request_id=req.request_id, finish_reason=FinishReason.LENGTH))

    def _kv_used(self) -> int:
        return sum(r.blocks(self.config.block_size) for r in self.running.values())

    def step(self, elapsed_ns: int) -> pb.StepReport:
        """One iteration's bookkeeping: decodes first, then prefill chunks within the budget."""
        budget = self.token_budget
        ordered = sorted(self.running.values(), key=lambda r: r.rank)
        while self._kv_used() > self.config.kv_blocks_total and ordered:  # out of blocks: preempt the least important
            victim = ordered.pop()
            del self.running[victim.request_id]
            self._preempted.append(victim.request_id)
        completing: list[SimRequest] = []
        num_tokens = 0
        for req in ordered:
            if req.decoding:
                req.computed += 1
                completing.append(req)
                budget -= 1
                num_tokens += 1
        for req in ordered:
            if req.decoding or budget <= 0:
                continue
            size = min(req.num_tokens - req.computed, budget, self._grants.get(req.request_id, budget))
            req.computed += size
            budget -= size
            num_tokens += size
            if req.decoding:
                completing.append(req)
        self._grants = {}
        deltas = []
        for req in completing:
            token = (hash(req.request_id) + req.generated) % self.config.vocab_size
            deltas.append(
                pb.TokenDelta(request_id=req.request_id, token_ids=[token], text=f" t{token}", index=req.generated)
            )
            req.generated += 1
            req.num_tokens += 1
            if req.generated >= req.max_tokens:
                self._finish(req)
        self.iteration += 1
        return self._report(deltas, num_tokens, elapsed_ns)

    def drain(self) -> pb.StepReport:
        return self._report([], 0, 0)

    def _report(self, deltas: list[pb.TokenDelta], num_tokens: int, elapsed_ns: int) -> pb.StepReport:
        report = pb.StepReport(
            iteration=self.iteration,
            plan_seq=self.plan_seq,
            tokens=deltas,
            finished=self._finished,
            preempted=self._preempted,
            rejected=self._rejected,
            load=pb.Load(
                num_running=len(self.running),
                kv_blocks_used=self._kv_used(),
                kv_blocks_total=self.config.kv_blocks_total,
                step_time_ns=elapsed_ns,
                num_tokens=num_tokens,
                source="sim",
                pending_prefill_tokens=sum(r.num_tokens - r.computed for r in self.running.values() if not r.decoding),
            ),
        )
        self._finished, self._preempted, self._rejected = [], [], []
        self._reported_seq = self.plan_seq
        return report


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


def snapshot(sims: list[RunningSim]) -> dict[str, object]:
    """Totals over all sims, and the plan latencies recorded since the last snapshot (then cleared)."""
    totals: dict[str, object] = {"time": time.time(), "count": len(sims)}
    for name in ("steps", "tokens", "reports", "plans", "admitted", "rejected", "finished", "busy_s"):
        totals[name] = sum(getattr(s.servicer.stats, name) for s in sims)
    latencies: list[float] = []
    for s in sims:
        latencies += s.servicer.stats.plan_latency_s
        s.servicer.stats.plan_latency_s = []
    totals["plan_latency_s"] = [round(x, 6) for x in latencies]
    totals["running"] = sum(len(s.servicer.engine.running) for s in sims)
    return totals


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
