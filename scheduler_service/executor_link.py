"""One scheduler replica's bidi ``Run`` stream to one executor: plans out, step reports in.

The link keeps the replica's view of the executor (its requests and latest load), records step
reports in Redis (``ReportWrites`` turns them into writes: one script call per batch of reports,
every report that arrived while the previous batch was written) and turns each admission into
plan deltas.
Plans are sent as soon as they are made; the executor applies them at its next iteration
boundary, so planning overlaps the model step instead of sitting on its critical path.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from functools import partial

import grpc

from common.config import SchedulerConfig, SecurityConfig
from common.lifecycle import FinishReason
from common.pb import executor_pb2 as pb
from common.pb import executor_pb2_grpc
from common.redis_client import with_redis_retry
from common.security import channel_credentials, fleet_metadata
from scheduler_service.linked_requests import LinkedRequest, capacity_of, linked_request_of, preemptible
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.placement import ExecutorCapacity
from scheduler_service.plans import admit_pb, prefill_grants
from scheduler_service.preemption import RunningRequest
from scheduler_service.report_writes import ReportWrites, coalesce
from scheduler_service.requests import ClaimedRequest
from scheduler_service.store import Store
from scheduler_service.store.prefix_index import CacheEvents
from scheduler_service.store.request_records import MIGRATE
from scheduler_service.store.step_publisher import StepWrite

log = logging.getLogger(__name__)

# The link's channel: keepalives notice a dead executor between reports, and plans and reports
# may be large (a whole prompt's token ids in an admission).
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]

# How often a link compares what Redis records running on its executor with what it drives.
# They part only when Redis loses acknowledged writes (a restart from an AOF missing its tail, a
# failover to a replica behind): a request whose finish or hand-back was lost would otherwise
# stay RUNNING for good, with nothing left to drive it. One SMEMBERS per executor per period.
_ORPHAN_CHECK_S = 2.0
_CHECK_ORPHANS = "check-orphans"  # the inbox's marker: compare with Redis now


class ExecutorLink:
    def __init__(
        self,
        executor_id: str,
        address: str,
        store: Store,
        config: SchedulerConfig,
        on_change: Callable[[bool], None],
        redis_retry_s: float = 30.0,
        security: SecurityConfig | None = None,
        metrics: SchedulerMetrics | None = None,
        stream_interval: tuple[int, int] = (1, 0),
        holder: str = "",
    ) -> None:
        """``holder``: the replica that holds the executor's lease, which fences this link's
        writes to the executor's prefix-cache index."""
        self.executor_id = executor_id
        self.address = address
        self.holder = holder
        self._store = store
        self._config = config
        self._on_change = on_change
        self.requests: dict[str, LinkedRequest] = {}
        self.info: pb.InfoResponse | None = None
        self.load: pb.Load | None = None
        self.iteration = 0
        self._channel: grpc.aio.Channel | None = None
        self._outbox: asyncio.Queue[pb.Plan | None] = asyncio.Queue()
        self._pending = pb.Plan()
        # Requests aborted here for a pending cancel: every report until the executor applies the
        # abort still carries their tokens, and each would send (and log) the abort again.
        self._cancel_aborted: set[str] = set()
        # Plan numbers start at a random base, so acknowledgements of an earlier stream's plans
        # (still in flight when this link attached) can never pass for this link's.
        self._base_seq = secrets.randbits(62) + 1
        self._seq = self._base_seq - 1
        # Names this link's assignments in Redis: writes from an older link to the same executor fail.
        self.owner = f"{executor_id}#{self._base_seq:x}"
        self._fence_seq = 0  # the stale-abort plan that must be acknowledged before admitting
        self._fenced = False  # fence() called: until then the link admits nothing
        self._acked_seq = 0  # newest plan the executor reported applied
        self._redis_retry_s = redis_retry_s
        self._security = security or SecurityConfig()
        self._metadata: tuple[tuple[str, str], ...] = ()  # sent on each call to the executor; see connect()
        self._metrics = metrics or SchedulerMetrics()
        self._report_writes = ReportWrites(executor_id, self.requests, self._metrics)
        # The server's stream interval (tokens, ms), sent down with each admission: the executor
        # holds a request's tokens for its client's chunks (executor_service/token_batching.py).
        self._stream_interval = stream_interval
        self.preempting: set[str] = set()  # preempt plans sent, not yet reported back
        # Admission's claims for this link that are in Redis, or may be, but not yet in
        # ``requests``: the orphan check leaves them to admission.
        self.claiming: set[str] = set()
        # Set by close(): admission must not hand this link work any more (its plans go nowhere).
        self.closed = False

    # ---- lifecycle ---------------------------------------------------------------------
    async def connect(self, timeout: float = 5.0) -> None:
        # Executors refuse every call without the fleet's secret (when the fleet has one).
        self._metadata = fleet_metadata(self._security)
        credentials = channel_credentials(self._security)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)
        stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self.info = await stub.Info(pb.InfoRequest(), timeout=timeout, metadata=self._metadata)

    def fence(self, stale: Iterable[str]) -> None:
        """Have the executor drop ``stale`` (what an earlier stream left there) before anything else.

        The link is not ``ready`` before this, and then not until the executor confirms the aborts,
        so no admit (of a re-queued stale request, say) goes out ahead of them and no re-admitted
        id is confused with the abort's CANCELLED report. Call it before re-queueing ``stale``.
        """
        stale = sorted(stale)
        if stale:
            self._fence_seq = self._next_seq()
            self._outbox.put_nowait(pb.Plan(seq=self._fence_seq, abort=stale))
        self._fenced = True

    async def run(self) -> None:
        """Drive the stream until it ends; ``connect`` and ``fence`` first."""
        if self._channel is None or not self._fenced:
            raise RuntimeError("connect() and fence() first")
        stub = executor_pb2_grpc.ExecutorStub(self._channel)
        call = stub.Run(self._plans(), metadata=self._metadata)
        inbox: asyncio.Queue[pb.StepReport | BaseException | str | None] = asyncio.Queue()
        reader = asyncio.create_task(read_reports(call, inbox), name=f"reports-{self.executor_id}")
        ticker = asyncio.create_task(_tick(inbox, _ORPHAN_CHECK_S), name=f"orphan-checks-{self.executor_id}")
        try:
            while True:
                # Group commit: every report that arrived while the last batch was being written
                # goes into the next one. Idle, that is one report, written at once; behind, a
                # few steps' tokens share one script call and one stream entry per request, so
                # the cost per report falls exactly when the replica is short of CPU.
                batch = [await inbox.get()]
                while not inbox.empty():
                    batch.append(inbox.get_nowait())
                reports = [r for r in batch if isinstance(r, pb.StepReport)]
                if reports:
                    await self._on_reports(reports)
                for item in batch:
                    if isinstance(item, BaseException):
                        raise item
                    if item is None:
                        return
                # Between report batches: every step written so far is in Redis, so what Redis
                # records running here and this link does not drive was lost there.
                if _CHECK_ORPHANS in batch:
                    await self.hand_back_orphans()
        finally:
            reader.cancel()
            ticker.cancel()

    async def close(self) -> None:
        self.closed = True
        self._outbox.put_nowait(None)
        if self._channel is not None:
            await self._channel.close(grace=0.5)

    async def _plans(self) -> AsyncIterator[pb.Plan]:
        while True:
            plan = await self._outbox.get()
            if plan is None:
                return
            yield plan

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ---- planning ----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.info is not None and self._fenced and self._acked_seq >= self._fence_seq

    def capacity(self, fraction: float = 1.0) -> ExecutorCapacity:
        """Room for new requests; ``fraction`` < 1 shrinks it under load (rounding up, so never to 0)."""
        assert self.info is not None
        max_batch = min(self.info.max_batch_size, self._config.batch_level.max_batch_size)
        # The executor runs under its own budget until the first plan sets this link's, and admits
        # by the budget it holds then: the larger of the two bounds a request's chunk either way.
        chunk = max(self.info.token_budget, self._token_budget(max_batch, 1.0))
        return capacity_of(self.executor_id, self.requests.values(), self.info, max_batch, fraction, chunk)

    def placed_marks(self) -> dict[str, int]:
        """The marks of prompts placed here whose first token has not come (``placement.PrefixMarks``):
        their blocks are being computed, and may not be in the fleet's index yet."""
        return {
            mark: 1 << k for r in self.requests.values() if r.generated == 0 for k, mark in enumerate(r.prefix_marks)
        }

    def running_requests(self) -> list[RunningRequest]:
        """What preemption may choose from: requests not already being preempted."""
        return preemptible(self.requests.values(), self.preempting, self.capacity())

    def _token_budget(self, max_batch: int, fraction: float) -> int:
        """The token budget a plan sets: never below max_batch + 1, as every running request decodes
        a token each step."""
        return max(max_batch + 1, int(self._config.token_level.token_budget * fraction))

    def preempt(self, request_ids: list[str]) -> None:
        """Ask the executor to give these back; they return to the queue with their tokens kept."""
        fresh = [rid for rid in request_ids if rid in self.requests and rid not in self.preempting]
        self.preempting.update(fresh)
        self._pending.preempt.extend(fresh)

    def admit(self, claimed: ClaimedRequest, cached_tokens: int = 0, prefix_marks: tuple[str, ...] = ()) -> None:
        """Send ``claimed`` with the next plan; ``cached_tokens``: its prefix the executor is
        expected to find in its cache, which it will not compute; ``prefix_marks``: its prompt's
        marks (``placement.PrefixMarks``)."""
        self.requests[claimed.request_id] = linked_request_of(claimed, cached_tokens, prefix_marks)
        tokens, ms = self._stream_interval
        # A request may ask for a coarser interval than the server's, never a finer one.
        self._pending.admit.append(admit_pb(claimed, max(tokens, claimed.params.stream_interval_tokens), ms))
        if not claimed.output_ids:  # a fresh stream: its readers here need no shared XREAD
            self._store.streams.expect_local(claimed.request_id)

    def abort(self, request_id: str) -> None:
        if request_id in self.requests:
            self._pending.abort.append(request_id)

    def flush(self, budget_fraction: float = 1.0) -> None:
        """Send the pending deltas, with prefill grants for the newly admitted, as one plan.

        ``budget_fraction`` < 1 (under load) shrinks the token budget, and so the prefill each
        step may add, which protects the running decodes' step time.
        """
        plan = self._pending
        if not (plan.admit or plan.abort or plan.preempt):
            return
        assert self.info is not None
        max_batch = min(self.info.max_batch_size, self._config.batch_level.max_batch_size)
        budget = self._token_budget(max_batch, budget_fraction)
        plan.token_budget = budget
        budget -= sum(1 for r in self.requests.values() if not r.prefilling)  # a token each for the decodes
        cached = {a.request_id: r.cached_tokens for a in plan.admit if (r := self.requests.get(a.request_id))}
        plan.prefill.extend(prefill_grants(plan.admit, budget, self._config.token_level.max_prefill_chunk, cached))
        plan.seq = self._next_seq()
        plan.iteration = self.iteration + 1
        self._outbox.put_nowait(plan)
        self._pending = pb.Plan()

    # ---- reports -----------------------------------------------------------------------
    async def _on_reports(self, reports: list[pb.StepReport]) -> None:
        """One or more consecutive step reports: record them together, then hand back what left."""
        before = (len(self.requests), self.ready)
        requeued = False
        writes: list[StepWrite] = []
        for report in reports:
            self.load = report.load
            self.iteration = report.iteration
            self._metrics.observe_load(self.executor_id, report.load)
            if self._base_seq <= report.plan_seq <= self._seq:
                self._acked_seq = max(self._acked_seq, report.plan_seq)
            writes += self._report_writes.of(report)
        self.preempting.intersection_update(self.requests)  # those that finished meanwhile
        if len(reports) > 1:
            writes = coalesce(writes)
        # The step's tokens and its prefix-cache events go to Redis together: two round trips one
        # after the other held up the next report, whose tokens clients wait on, for the second
        # (2.6 ms median on two busy cores, in two steps of five).
        events = _cache_events(reports)
        indexed = asyncio.ensure_future(self._index_cache(events)) if events else None
        try:
            if writes:
                recorded = await with_redis_retry(
                    lambda: self._store.steps.publish(self.executor_id, writes, self.owner),
                    self._redis_retry_s,
                    f"recording a step of {self.executor_id}",
                )
                requeued = await self._recover_refused(writes, recorded.accepted)
                self._abort_cancelled(recorded.cancel_pending)
        except BaseException:  # the link ends (the next stream's first report rebuilds the set)
            if indexed is not None:
                indexed.cancel()
                await asyncio.gather(indexed, return_exceptions=True)
            raise
        if indexed is not None:
            await indexed
        for report in reports:
            for request_id in [*report.preempted, *(r.request_id for r in report.rejected)]:
                ordered = request_id in self.preempting  # by the scheduler: counted as it ordered it
                self.preempting.discard(request_id)
                if self.requests.pop(request_id, None) is not None:
                    self._report_writes.forget(request_id)
                    if request_id in report.preempted and not ordered:
                        self._metrics.preemptions.inc()
                    # Retried: a Redis blip here would end the link, and every request on it would migrate.
                    await with_redis_retry(partial(self.hand_back, request_id), self._redis_retry_s, "a hand-back")
                    requeued = True
        # Wake the planner only when its inputs moved: a request left (finished, handed back or
        # refused), freeing room, or the link became ready. A step that only added tokens shrinks
        # room, never grows it, and the planner's tick covers time-based decisions. A hand-back
        # always wakes it (an admit made during the write may hide it in the count), and
        # ``requeued`` says the queue moved: room alone is no reason to re-read an empty queue.
        if requeued or (len(self.requests), self.ready) != before:
            self._on_change(requeued)

    def _abort_cancelled(self, request_ids: list[str]) -> None:
        """Abort requests Redis says a cancel is pending for. A cancel's abort reaches this link
        only for a request it already drives: one that landed while the request was being claimed
        (or rode in the same plan as its admit, which the executor applies after the abort) was
        lost, and the request ran on to its end. Its executor reports it CANCELLED once aborted."""
        if self._cancel_aborted:  # those that left the link need no memory (runs every report: mostly empty)
            self._cancel_aborted = {rid for rid in self._cancel_aborted if rid in self.requests}
        aborting = [rid for rid in request_ids if rid in self.requests and rid not in self._cancel_aborted]
        self._cancel_aborted.update(aborting)
        for request_id in aborting:
            log.info("request %s: a cancel is pending; aborting it on %s", request_id, self.executor_id)
            self.abort(request_id)
        if aborting:
            self.flush()

    async def _index_cache(self, events: list[CacheEvents]) -> None:
        """Apply consecutive reports' prefix-cache events to the fleet's index, in report order
        (each call's before the next report's: the link awaits both). A failure the retry does not
        ride out ends the link, and the next stream's first report rebuilds the set."""
        await with_redis_retry(
            lambda: self._store.prefixes.apply(self.executor_id, events, self.holder),
            self._redis_retry_s,
            f"indexing the prefix cache of {self.executor_id}",
        )

    async def _recover_refused(self, writes: list[StepWrite], accepted: list[bool]) -> bool:
        """Redis refused tokens of a request this link still drives.

        Either its record is behind the executor (a write a Redis primary acknowledged, then lost
        in a failover before replicating it) or another owner took it. Left alone, every later
        write would be refused too and its stream would stall for good. So abort it on the
        executor, admit nothing here until the executor confirms the abort (as when a link
        starts), and hand it back: it resumes from what Redis recorded, and readers trim any
        prefix a client already saw. A refused final write counts too: the request left this
        link's table when its report came in, but Redis did not end it, and nothing else will.
        Returns whether it handed any back.
        """
        refused = [
            w.request_id
            for w, ok in zip(writes, accepted, strict=True)
            if not ok and (w.request_id in self.requests or w.event.finish_reason is not FinishReason.NONE)
        ]
        if not refused:
            return False
        for request_id in refused:
            self.requests.pop(request_id, None)
            self._report_writes.forget(request_id)
            self.preempting.discard(request_id)
        self._fence_seq = self._next_seq()
        self._outbox.put_nowait(pb.Plan(seq=self._fence_seq, abort=refused))
        for request_id in refused:
            log.warning("request %s: Redis refused its tokens from %s; re-queued", request_id, self.executor_id)
            hand_back = partial(self._store.requests.hand_back, request_id, self.executor_id, MIGRATE, self.owner)
            await with_redis_retry(hand_back, self._redis_retry_s, "a hand-back of refused tokens")
        return True

    async def hand_back_orphans(self) -> None:
        """Re-queue what Redis records running on this executor that this link no longer drives.

        A request's end (or hand-back) that Redis acknowledged and then lost, with the AOF's tail
        or in a failover, leaves its record RUNNING here with its tokens cut back, and no report
        will ever come for it: the executor is done with it. Re-queued, it resumes from what Redis
        recorded and ends again, so every record reaches a terminal state. Its migrations and
        preemptions are not charged: nothing failed but Redis.

        Claims admission is still making for this link are left to it (read before the running
        set and again before each hand-back, so none slips between). A record another link owns
        (a claim an older or another replica's link made after this one started, its hand-back
        lost with that link) is re-queued only while this replica holds the executor's lease:
        a link whose replica lost the lease leaves alone what the new driver runs. Each hand-back
        is fenced by the owner it read, so one that changed hands meanwhile is not touched. No
        abort is sent: the executor runs nothing this link does not drive.
        """
        claiming = set(self.claiming)
        requests, fleet, retry_s = self._store.requests, self._store.fleet, self._redis_retry_s
        what = f"checking what runs on {self.executor_id}"
        recorded = await with_redis_retry(partial(requests.running_ids, self.executor_id), retry_s, what)
        candidates = sorted(recorded - self.requests.keys() - claiming - self.claiming)
        if not candidates:
            return
        owners = await with_redis_retry(partial(requests.owners, candidates), retry_s, what)
        orphans = [(rid, owner or self.owner) for rid, owner in zip(candidates, owners, strict=True)]
        if any(owner != self.owner for _, owner in orphans):
            holder = await with_redis_retry(partial(fleet.lease_holder, self.executor_id), retry_s, what)
            if not self.holder or holder != self.holder:
                orphans = [(rid, owner) for rid, owner in orphans if owner == self.owner]
        handed_back = False
        for request_id, owner in orphans:
            if request_id in self.requests or request_id in self.claiming:
                continue  # admitted here meanwhile
            log.warning(
                "request %s: Redis records it running on %s, but no report will come for it; re-queuing",
                request_id,
                self.executor_id,
            )
            hand_back = partial(requests.hand_back, request_id, self.executor_id, "orphan", owner)
            await with_redis_retry(hand_back, retry_s, what)
            handed_back = True
        if handed_back:
            self._on_change(True)

    async def hand_back(self, request_id: str, kind: str = "preempt") -> None:
        await self._store.requests.hand_back(request_id, self.executor_id, kind, self.owner)


async def read_reports(
    call: AsyncIterable[pb.StepReport], inbox: asyncio.Queue[pb.StepReport | BaseException | str | None]
) -> None:
    """Move the stream's reports into ``inbox``; then None at its end, or the error that ended it."""
    try:
        async for report in call:
            inbox.put_nowait(report)
        inbox.put_nowait(None)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        inbox.put_nowait(exc)


async def _tick(inbox: asyncio.Queue[pb.StepReport | BaseException | str | None], period_s: float) -> None:
    """Put the orphan-check marker in ``inbox`` every ``period_s``."""
    while True:
        await asyncio.sleep(period_s)
        inbox.put_nowait(_CHECK_ORPHANS)


def _cache_events(reports: list[pb.StepReport]) -> list[CacheEvents]:
    """The reports' prefix-cache events, in report order; empty when none changed the cache (the
    common case: executors send the field only when their cache changed)."""
    if not any(r.HasField("kv_events") for r in reports):
        return []
    events = [CacheEvents(r.kv_events.cleared, tuple(r.kv_events.stored), tuple(r.kv_events.removed)) for r in reports]
    return [] if all(ev.empty for ev in events) else events
