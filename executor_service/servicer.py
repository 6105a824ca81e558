"""The Executor gRPC servicer: a thin edge over the engine worker and the report hub."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from common.pb import executor_pb2 as pb
from common.pb import executor_pb2_grpc
from executor_service.convert import plan_from_pb, report_to_pb
from executor_service.engine_io import PlanUpdate, StepOutput
from executor_service.load_metrics import LoadSampler
from executor_service.metrics import ExecutorMetrics
from executor_service.report_hub import ReportHub
from executor_service.worker import EngineWorker

log = logging.getLogger(__name__)


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(
        self,
        worker: EngineWorker,
        hub: ReportHub,
        load: LoadSampler,
        info: pb.InfoResponse,
        metrics: ExecutorMetrics | None = None,
    ) -> None:
        self._metrics = metrics or ExecutorMetrics()
        self._worker = worker
        self._hub = hub
        self._load = load
        self._info = info

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return self._info

    async def Run(
        self, request_iterator: AsyncIterator[pb.Plan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepReport]:
        queue = self._hub.attach()
        log.info("scheduler attached to Run stream %s", context.peer())
        reader = asyncio.create_task(self._read_plans(request_iterator, queue))
        try:
            while True:
                out: StepOutput | None = await queue.get()
                if out is None:
                    break
                device = self._load.sample()
                self._metrics.observe(out, device)
                yield report_to_pb(out, device)
        finally:
            reader.cancel()
            if self._hub.detach(queue):
                # Nobody drives this executor now: its requests are re-queued by the next driver,
                # so stop computing them and free their KV blocks.
                self._worker.submit(PlanUpdate(seq=0, abort_all=True))
            log.info("Run stream %s ended", context.peer())

    async def _read_plans(self, plans: AsyncIterator[pb.Plan], queue: asyncio.Queue[StepOutput | None]) -> None:
        try:
            async for plan in plans:
                self._worker.submit(plan_from_pb(plan))
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            queue.put_nowait(None)  # the scheduler closed its side: end the report stream too
