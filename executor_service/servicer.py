"""The Executor gRPC servicer: a thin edge over the engine worker and the report hub."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry.trace import Span

from common.errors import NotReady
from common.pb import executor_pb2 as pb
from common.pb import executor_pb2_grpc
from common.tracing import start_request_span
from executor_service.convert import plan_from_pb, report_to_pb
from executor_service.engine_io import PlanUpdate, StepOutput
from executor_service.load_metrics import LoadSampler
from executor_service.metrics import ExecutorMetrics
from executor_service.report_hub import ReportHub, ReportQueue
from executor_service.token_batching import StreamInterval, TokenBatcher
from executor_service.worker import EngineWorker

log = logging.getLogger(__name__)


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """Serves as soon as the port is bound; answers UNAVAILABLE until ``bind`` (model loaded and warmed),
    and again once the engine thread has failed."""

    def __init__(
        self,
        metrics: ExecutorMetrics | None = None,
        tracing: bool = False,
        token_batcher: Callable[[], TokenBatcher] = lambda: TokenBatcher(1, 0.0),  # one per stream
    ) -> None:
        self._metrics = metrics or ExecutorMetrics()
        self._tracing = tracing
        self._token_batcher = token_batcher
        self._spans: dict[str, Span] = {}  # one per running request, when tracing
        self._readers: set[asyncio.Task[None]] = set()
        self._worker: EngineWorker | None = None
        self._hub: ReportHub | None = None
        self._load: LoadSampler | None = None
        self._info: pb.InfoResponse | None = None

    def bind(self, worker: EngineWorker, hub: ReportHub, load: LoadSampler, info: pb.InfoResponse) -> None:
        self._worker, self._hub, self._load, self._info = worker, hub, load, info

    def _ready(self) -> tuple[EngineWorker, ReportHub, LoadSampler, pb.InfoResponse]:
        if self._worker is None or self._hub is None or self._load is None or self._info is None:
            raise NotReady("the model is still loading")
        if self._worker.error is not None:  # the executor is leaving the fleet (``RunningExecutor.withdraw``)
            raise NotReady(f"the engine failed: {self._worker.error!r}")
        return self._worker, self._hub, self._load, self._info

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return self._ready()[3]

    async def Run(self, request_iterator: AsyncIterator[pb.Plan], context: grpc.aio.ServicerContext) -> None:
        """Plans in, step reports out, until either side ends.

        Nothing here touches the call once this coroutine has returned. grpc.aio releases the
        core call as soon as the handler finishes, and a cancelled handler never sends a status,
        so the context still looks live: ``context.peer()`` on it then dereferences a null call
        (SIGSEGV in cygrpc). That is how the executor crashed when its Run stream ended mid-run
        (its scheduler SIGKILLed, or its link dropped in a Redis failover): the handler was an
        async generator, left suspended at its ``yield`` when the cancel hit grpc's write, and
        finalized later, after the release, with ``context.peer()`` in its ``finally``. Hence:
        reports go out with ``context.write`` from this plain coroutine, whose ``finally`` runs
        inside the handler; the peer is read once, up front; and the plan reader is cancelled
        before returning, so it never issues a read on a released call.
        """
        worker, hub, load, _ = self._ready()
        peer = context.peer()  # read while the call is certainly live (see above)
        batcher = self._token_batcher()
        superseding = hub.attached
        queue = hub.attach(batcher)  # the hub offers each step to ``batcher`` on the engine thread
        if superseding:
            # Nobody drives what the old stream admitted. The new driver re-queues and aborts what
            # Redis records running here, but a request the old driver claimed after that read
            # would run on unseen (its reports dropped) until its last token: stop it all before
            # the new stream's first plan.
            worker.submit(PlanUpdate(seq=0, abort_all=True))
            for request_id in list(self._spans):
                self._end_span(request_id, "DROPPED")
        log.info("scheduler attached to Run stream %s", peer)
        reader = asyncio.create_task(self._read_plans(worker, hub, request_iterator, queue, batcher))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        try:
            while True:
                report: StepOutput | None = await queue.get()
                if report is None or reader.done() or context.done():
                    break
                self._end_spans(report)
                device = load.sample()
                self._metrics.observe_device(device)
                try:
                    await context.write(report_to_pb(report, device))
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError) as exc:
                    log.info("Run stream %s: write failed, the call is over (%s)", peer, exc)
                    break
        finally:
            # The reader is cancelled here, while the call is still held: cancelling its pending
            # read is safe (grpc drops the completion of a cancelled read), while a read started
            # after this handler returned would go to a released call. Once cancelled it only
            # unwinds: it starts no read and submits no plan (not even one whose read has just
            # completed), so none follows the abort below. Nothing here awaits: grpc cancels this
            # task when the client goes, and a cancel landing on an await here would skip the rest.
            reader.cancel()
            if hub.detach(queue):
                # Nobody drives this executor now: its requests are re-queued by the next driver,
                # so stop computing them and free their KV blocks (and end their spans here).
                worker.submit(PlanUpdate(seq=0, abort_all=True))
                for request_id in list(self._spans):
                    self._end_span(request_id, "DROPPED")
            log.info("Run stream %s ended", peer)

    async def _read_plans(
        self,
        worker: EngineWorker,
        hub: ReportHub,
        plans: AsyncIterator[pb.Plan],
        queue: ReportQueue,
        batcher: TokenBatcher,
    ) -> None:
        try:
            async for plan in plans:
                if not hub.is_current(queue):
                    # Superseded by a newer stream (its scheduler now drives): a plan read after that,
                    # applied behind the new stream's, would overwrite the sequence number it reports
                    # (its fence never acknowledged) and run requests no one drives.
                    break
                self._start_spans(plan)
                for request_id in plan.abort:
                    batcher.forget(request_id)
                for admit in plan.admit:
                    batcher.admitted(
                        admit.request_id,
                        StreamInterval(max(1, admit.stream_interval_tokens), admit.stream_interval_ms),
                    )
                worker.submit(plan_from_pb(plan))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError, RuntimeError):
            pass  # the call ended
        finally:
            queue.put_nowait(None)  # the scheduler closed its side: end the report stream too

    def _start_spans(self, plan: pb.Plan) -> None:
        if not self._tracing:
            return
        for admit in plan.admit:
            old = self._spans.pop(admit.request_id, None)
            if old is not None:
                old.end()
            self._spans[admit.request_id] = start_request_span(
                "baton.executor.request", admit.request_id, admit.traceparent
            )

    def _end_spans(self, out: StepOutput) -> None:
        if not self._spans:
            return
        for finished in out.finished:
            self._end_span(finished.request_id, finished.reason.name)
        for request_id in out.preempted:
            self._end_span(request_id, "PREEMPTED")
        for rejected in out.rejected:
            self._end_span(rejected.request_id, "REJECTED")

    def _end_span(self, request_id: str, outcome: str) -> None:
        span = self._spans.pop(request_id, None)
        if span is not None:
            span.set_attribute("baton.finish_reason", outcome)
            span.end()
