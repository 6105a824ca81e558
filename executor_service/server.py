"""The executor service: load the model, serve Executor over gRPC, register in Redis, shut down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health

from common import service
from common.block_hashing import BlockNaming
from common.config import BatonConfig
from common.gc_heap import freeze_startup_heap
from common.health import add_health_and_reflection, set_serving
from common.keys import KeySchema
from common.metrics import serve_metrics
from common.pb import executor_pb2 as pb
from common.pb import executor_pb2_grpc
from common.redis_client import check_deployment, connect
from common.sampling_params import SamplingParams
from common.security import fleet_secret
from common.tracing import setup_tracing
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, PlanUpdate
from executor_service.host_peers import HostPeers
from executor_service.load_metrics import LoadSampler
from executor_service.metrics import ExecutorMetrics
from executor_service.model_loader import LoadedModel, load_engine
from executor_service.model_support import UnsupportedModel
from executor_service.registration import Registration
from executor_service.report_hub import ReportHub
from executor_service.servicer import ExecutorServicer
from executor_service.token_batching import TokenBatcher
from executor_service.worker import EngineWorker

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name


@dataclass
class RunningExecutor:
    """Handles of a started executor, for tests and the entrypoint."""

    executor_id: str
    address: str
    port: int
    server: grpc.aio.Server
    worker: EngineWorker
    registration: Registration
    health: health.aio.HealthServicer
    loaded: LoadedModel
    metrics: ExecutorMetrics
    hub: ReportHub
    engine_failed: asyncio.Event  # set on the event loop once the engine thread has died
    withdrawn: asyncio.Event = field(default_factory=asyncio.Event)  # ``withdraw`` has run
    peers: HostPeers | None = None  # its registration among the host's executors
    _watcher: asyncio.Task[None] | None = None

    def watch_engine(self) -> None:
        """Withdraw from the fleet as soon as the engine thread dies."""
        self._watcher = asyncio.create_task(self._withdraw_when_failed(), name=f"engine-watch-{self.executor_id}")

    async def _withdraw_when_failed(self) -> None:
        await self.engine_failed.wait()
        await self.withdraw()

    async def withdraw(self) -> None:
        """Leave the fleet while the process lives on: the engine thread died, so this executor would
        accept plans and never run them. The Run stream ends, so the link driving it re-queues its
        requests at once and they run elsewhere, re-prefilled from the tokens Redis holds; health
        says NOT_SERVING, every call gets UNAVAILABLE, and the heartbeats stop while the executor
        stays registered, so the schedulers reap it as dead: whatever Redis still records running
        here (a request whose link could not hand it back) is re-queued then. ``serve`` then exits
        non-zero, for a supervisor to start a fresh process."""
        try:
            log.error(
                "executor %s: the engine thread failed (%r); leaving the fleet, its requests are re-queued",
                self.executor_id,
                self.worker.error,
            )
            self.hub.end_stream()
            await set_serving(self.health, [SERVICE_NAME], serving=False)
            await self.registration.fall_silent()
        finally:
            self.withdrawn.set()  # whatever failed above, ``serve`` must still end the process

    async def stop(self, grace: float = 2.0) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await set_serving(self.health, [SERVICE_NAME], serving=False)
        if self.worker.error is None:
            await self.registration.stop()
        else:  # left to the schedulers' reaper, which re-queues what Redis still records here
            await self.registration.fall_silent()
        await self.server.stop(grace)
        await asyncio.to_thread(self.worker.stop)
        if self.peers is not None:
            self.peers.close()  # no longer a neighbour whose steps take a core
        if self.loaded.engine.grammars is not None:
            self.loaded.engine.grammars.close()


def _info(executor_id: str, loaded: LoadedModel, config: BatonConfig) -> pb.InfoResponse:
    engine = loaded.engine
    return pb.InfoResponse(
        executor_id=executor_id,
        model=loaded.model_name,
        max_model_len=engine.limits.max_model_len,
        kv_blocks_total=engine.allocator.num_blocks,
        block_size=engine.allocator.block_size,
        dtype=loaded.dtype,
        device=str(loaded.device),
        max_batch_size=engine.limits.max_batch_size,
        token_budget=engine.limits.token_budget,
        eos_token_ids=sorted(engine.limits.eos_token_ids),
        vocab_size=loaded.vocab_size,
        prefix_caching=engine.allocator.prefix_caching,
        backend=loaded.backend,
        kv_window_tokens=engine.window.releasing_size if engine.window is not None else 0,
    )


def warm_up(engine: Engine, model: str = "the model") -> None:
    """Run one tiny request through every stage, so the first real one pays no first-call costs.

    A model whose first step fails is refused here, before the executor registers, with the
    reason: its config passed every check (``model_support``), but its layers do not run under
    Baton's attention (a family that does not hand the attention its own keyword arguments, an
    unusual K/V layout), which only running it shows."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    # Only a tiny request: a large one here (a prefill of 256 tokens, so that the CPU thread governor
    # would predict the first long prompt's work) left the small model's shared-prefix workload end to
    # end about 10 % slower on an AMX Xeon, whatever the governor learned from it (docs/performance.md,
    # "Threads chosen per step"); the governor learns from the first real large step instead.
    requests = (AdmitSpec("__warmup__", (1, 2, 3, 4), (), params, 0.0),)
    try:
        engine.apply(PlanUpdate(seq=0, admit=requests))
        while engine.has_work:
            engine.step()
        engine.drain()
    except Exception as exc:
        raise UnsupportedModel(
            f"{model}: its first step failed ({type(exc).__name__}: {exc}); refusing to serve it"
        ) from exc
    engine.prefix_cache.queries = engine.prefix_cache.hits = 0  # counters count requests only


async def start_executor(config: BatonConfig, before_serving: Callable[[], object] | None = None) -> RunningExecutor:
    """Bind the port first (health: NOT_SERVING), then load and warm the model, then SERVING.
    ``before_serving``: called once warm, before the executor registers and reports SERVING."""
    cfg = config.executor
    dist = config.distributed
    redis = connect(dist.redis_url)
    await check_deployment(redis, dist.redis_url)  # before minutes of model loading
    executor_id = cfg.executor_id or f"exec-{uuid.uuid4().hex[:8]}"
    tracing = setup_tracing("baton-executor", config.monitoring.tracing, config.monitoring.otlp_endpoint)
    secret = fleet_secret(config.security)
    server = service.make_server(config.scheduler.max_message_bytes, tracing=tracing, fleet_secret=secret)
    metrics = ExecutorMetrics()
    servicer = ExecutorServicer(metrics, tracing, lambda: TokenBatcher(cfg.report_every_steps, cfg.report_max_wait_ms))
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    health_servicer = add_health_and_reflection(server, [SERVICE_NAME])
    await set_serving(health_servicer, [SERVICE_NAME], serving=False)
    port = service.add_port(server, f"{cfg.host}:{cfg.port}", config.security)
    address = service.advertise_address(cfg.host, port, cfg.advertise_address)
    await server.start()
    serve_metrics(metrics.registry, config.monitoring.executor_metrics_port)
    peers = HostPeers()
    try:
        # Named as the fleet's schedulers name prompts, keyed by the same secret (common/block_hashing.py).
        loaded = await asyncio.to_thread(load_engine, cfg, peers, BlockNaming.for_fleet(secret))
        await asyncio.to_thread(warm_up, loaded.engine, loaded.model_name)
    except BaseException:
        # A model refused (or a stop while loading): close the port here, not in a finalizer
        # after the event loop has closed (a spurious traceback after the refusal's message).
        await server.stop(0)
        await redis.aclose()
        raise
    metrics.backend.labels(loaded.backend).set(1)
    load = LoadSampler(str(loaded.device))
    allocator = loaded.engine.allocator
    loop = asyncio.get_running_loop()
    hub = ReportHub(loop, metrics.observe_step, allocator.cached_names if allocator.prefix_caching else None)
    engine_failed = asyncio.Event()

    def on_engine_failure(exc: BaseException) -> None:  # on the engine thread
        with contextlib.suppress(RuntimeError):  # the loop already closed: the process is stopping anyway
            loop.call_soon_threadsafe(engine_failed.set)

    worker = EngineWorker(loaded.engine, hub.publish_threadsafe, on_engine_failure)
    info = _info(executor_id, loaded, config)
    servicer.bind(worker, hub, load, info)
    worker.start()

    def load_summary() -> dict[str, object]:
        out = hub.latest
        if out is None:
            return {"num_running": 0, "kv_blocks_used": 0, "kv_blocks_total": info.kv_blocks_total}
        return {
            "num_running": out.num_running,
            "kv_blocks_used": out.kv_blocks_used,
            "kv_blocks_total": out.kv_blocks_total,
            "step_time_ms": out.step_time_ns / 1e6,
            "iteration": out.iteration,
            # Since the executor started, in tokens: what baton inspect shows as the hit rate.
            "prefix_cache_queries": out.prefix_cache_queries,
            "prefix_cache_hits": out.prefix_cache_hits,
        }

    registration = Registration(
        redis,
        KeySchema(dist.key_prefix),
        executor_id,
        {
            "address": address,
            "model": loaded.model_name,
            "max_model_len": info.max_model_len,
            "vocab_size": info.vocab_size,
            "kv_blocks_total": info.kv_blocks_total,
            "block_size": info.block_size,
            "kv_window_tokens": info.kv_window_tokens,
            "max_batch_size": info.max_batch_size,
            "device": info.device,
            "dtype": info.dtype,
            "prefix_caching": int(info.prefix_caching),
            "sampling_defaults": loaded.sampling_defaults.to_json(),
            "started_ms": int(time.time() * 1000),
        },
        load_summary,
        dist.heartbeat_interval_ms,
        dist.executor_timeout_ms,
    )
    if before_serving is not None:
        before_serving()  # serve() freezes the heap here: its full collection never stalls a request
    await registration.start()
    await set_serving(health_servicer, [SERVICE_NAME], serving=True)
    log.info("executor %s serving at %s", executor_id, address)
    running = RunningExecutor(
        executor_id,
        address,
        port,
        server,
        worker,
        registration,
        health_servicer,
        loaded,
        metrics,
        hub,
        engine_failed,
        peers=peers,
    )
    running.watch_engine()
    return running


async def serve(config: BatonConfig) -> int:
    """Run until SIGINT/SIGTERM (exit status 0), or until the engine thread fails (1)."""
    stop = asyncio.Event()
    service.install_signal_handlers(stop)
    running = await start_executor(config, before_serving=freeze_startup_heap)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(running.withdrawn.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for waiting in waits:
        waiting.cancel()
    service.bound_shutdown()
    log.info("executor %s shutting down after %d steps", running.executor_id, running.worker.engine.iteration)
    await running.stop()
    return 0 if running.worker.error is None else 1
