"""The scheduler service: public Generation API plus the dispatcher that drives executors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health
from redis.exceptions import RedisError

from common import service
from common.config import BatonConfig
from common.gc_heap import freeze_startup_heap
from common.health import add_health_and_reflection, set_serving
from common.keys import KeySchema
from common.metrics import serve_metrics
from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from common.periodic import Periodic
from common.redis_client import check_deployment, connect
from common.security import fleet_secret, load_tokens
from common.tracing import setup_tracing
from scheduler_service.dispatcher import Dispatcher
from scheduler_service.fleet_signals import FleetSignals
from scheduler_service.frontend import Frontend
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.scoring import RequestScorer
from scheduler_service.servicer import GenerationServicer
from scheduler_service.store import Store
from scheduler_service.tokenizer_source import TokenizerSource

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# GenerateBatch judges each request it reads on its own, undecodable ones included.
CHECKED_STREAMS = (f"/{SERVICE_NAME}/GenerateBatch",)


@dataclass
class RunningScheduler:
    port: int
    server: grpc.aio.Server
    store: Store
    dispatcher: Dispatcher
    frontend: Frontend
    health: health.aio.HealthServicer
    servicer: GenerationServicer
    metrics_port: int = 0
    readiness: Periodic | None = None
    signals: Periodic | None = None  # the fleet-wide autoscaling gauges
    forgetting: Periodic | None = None  # tenants gone idle

    async def stop(self, grace: float = 2.0) -> None:
        for loop in (self.readiness, self.signals, self.forgetting):
            if loop is not None:
                await loop.stop()
        await set_serving(self.health, [SERVICE_NAME], serving=False)
        # The streams still open when the grace ends are cut, their requests left running (not
        # taken for clients that left): each client follows its request on another replica.
        self.servicer.stop_serving()
        await self.server.stop(grace)
        await self.dispatcher.stop()
        await self.store.close()


async def start_scheduler(
    config: BatonConfig, after_tokenizer_load: Callable[[], object] | None = None
) -> RunningScheduler:
    dist = config.distributed
    redis = connect(dist.redis_url)
    await check_deployment(redis, dist.redis_url)
    store = Store(redis, KeySchema(dist.key_prefix), dist.request_ttl_s, dist.max_migrations)
    metrics = SchedulerMetrics()
    scorer = RequestScorer(config)
    dispatcher = Dispatcher(store, config, metrics=metrics, scorer=scorer)
    tokenizers = TokenizerSource(store.fleet, config.scheduler.tokenizer, after_tokenizer_load)
    frontend = Frontend(store, dispatcher, tokenizers, config, scorer, metrics)
    tracing = setup_tracing("baton-scheduler", config.monitoring.tracing, config.monitoring.otlp_endpoint)
    tokens = load_tokens(config.security.auth_tokens_file)
    fleet_secret(config.security)  # an unreadable secret file fails start-up, not every executor link
    server = service.make_server(config.scheduler.max_message_bytes, tokens, tracing, CHECKED_STREAMS)
    servicer = GenerationServicer(frontend, metrics)
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = add_health_and_reflection(server, [SERVICE_NAME])
    await set_serving(health_servicer, [SERVICE_NAME], serving=False)
    port = service.add_port(server, f"{config.scheduler.host}:{config.scheduler.port}", config.security)
    await server.start()
    metrics_port = serve_metrics(metrics.registry, config.monitoring.metrics_port)
    await dispatcher.start()
    readiness = Periodic(_Readiness(store, health_servicer).check, _Readiness.INTERVAL_S, "readiness")
    readiness.start()
    fleet = FleetSignals(store.queue, store.fleet, metrics, dist.executor_timeout_ms)
    signals = Periodic(fleet.refresh_quietly, 1.0, "fleet-signals")
    signals.start()
    forgetting = None
    if (idle_s := config.scheduler.request_level.forget_idle_tenants_s) > 0:
        forgetter = _IdleTenantsForgetter(store, idle_s)
        forgetting = Periodic(forgetter.step, _IdleTenantsForgetter.INTERVAL_S, "idle-tenants")
        forgetting.start()
    log.info("scheduler %s listening on port %d", dispatcher.replica_id, port)
    return RunningScheduler(
        port,
        server,
        store,
        dispatcher,
        frontend,
        health_servicer,
        servicer,
        metrics_port,
        readiness,
        signals,
        forgetting,
    )


class _Readiness:
    """SERVING exactly while Redis answers: without it the scheduler can neither queue nor stream."""

    INTERVAL_S = 1.0

    def __init__(self, store: Store, health_servicer: health.aio.HealthServicer) -> None:
        self._store = store
        self._health = health_servicer
        self._serving: bool | None = None

    async def check(self) -> None:
        try:
            ok = await asyncio.wait_for(self._store.ping(), timeout=self.INTERVAL_S)
        except (RedisError, OSError, TimeoutError):
            ok = False
        if ok != self._serving:
            self._serving = ok
            await set_serving(self._health, [SERVICE_NAME], serving=ok)
            log.info("health: %s (Redis %s)", "SERVING" if ok else "NOT_SERVING", "up" if ok else "unreachable")


class _IdleTenantsForgetter:
    """Drops the fairness and estimator state of tenants idle ``idle_s`` (``store.idle_tenants``)."""

    INTERVAL_S = 60.0

    def __init__(self, store: Store, idle_s: int) -> None:
        self._store = store
        self._idle_s = idle_s

    async def step(self) -> None:
        try:
            if forgotten := await self._store.tenants.forget(self._idle_s):
                log.info("forgot %d tenants idle for %d s", forgotten, self._idle_s)
        except (RedisError, OSError) as e:  # an outage only delays it; readiness reports the outage
            log.debug("forgetting idle tenants failed: %s", e)


async def serve(config: BatonConfig) -> None:
    stop = asyncio.Event()
    service.install_signal_handlers(stop)
    running = await start_scheduler(config, after_tokenizer_load=freeze_startup_heap)
    freeze_startup_heap()  # before the readiness task has run: health still says NOT_SERVING
    await stop.wait()
    service.bound_shutdown()
    log.info("scheduler shutting down")
    await running.stop()
