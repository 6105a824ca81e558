"""The scheduler replica's coordinator: discover executors, hold their leases, drive their links,
and admit pending requests to them each iteration.

Thin by design: placement is pure (``placement.place``), Redis is the ``Store``'s (its ``fleet``
holds the registry and the leases), and each executor's stream is its own ``ExecutorLink``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

import grpc
from redis.exceptions import RedisError

from common.config import BatonConfig
from scheduler_service.admission import Admission
from scheduler_service.executor_link import ExecutorLink
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.scoring import RequestScorer
from scheduler_service.store import Store
from scheduler_service.store.request_records import HANDOVER, MIGRATE

log = logging.getLogger(__name__)

_PLAN_TICK_S = 0.05


class Dispatcher:
    def __init__(
        self,
        store: Store,
        config: BatonConfig,
        replica_id: str = "",
        metrics: SchedulerMetrics | None = None,
        scorer: RequestScorer | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.replica_id = replica_id or f"sched-{uuid.uuid4().hex[:8]}"
        self.links: dict[str, ExecutorLink] = {}
        self.metrics = metrics or SchedulerMetrics()
        store.requests.on_quarantine = self.metrics.malformed.inc
        store.requests.on_end = self.metrics.count_end
        self._classes_refreshed = 0.0
        # Loops also check this flag: a cancel swallowed inside a client library must not leave
        # a zombie replica renewing leases after stop().
        self._stopping = False
        self._wake = asyncio.Event()
        self._queue_moved = False  # a wake since the last round said the queue may hold new work
        self._tasks: list[asyncio.Task[None]] = []
        self._link_tasks: dict[str, asyncio.Task[None]] = {}
        # Executors whose ended link is still cleaning up (handing back its requests, dropping its
        # index, releasing its lease): no new link takes them until it is done, as the cleanup's
        # drop and release, fenced by this replica's id, would undo the new link's index and lease.
        self._closing: set[str] = set()
        self._redis_answered_ms = 0  # when discovery last heard from Redis (wall ms; 0: never)
        self._judge_heartbeats_from_ms = 0  # after an outage, stale heartbeats are no verdict until then
        self.scorer = scorer or RequestScorer(config)  # the frontend scores arrivals with it too
        self.admission = Admission(store, config, self.scorer, self.metrics)
        self.control = store.control

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._discovery_loop(), name="discovery"),
            asyncio.create_task(self._planning_loop(), name="planning"),
            asyncio.create_task(self._control_loop(), name="control"),
        ]

    async def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        # Closing the channels ends the Run streams, so each link task unwinds on its own,
        # handing its requests back, instead of waiting on a read that a cancel may not reach; a
        # cancel now would cut those hand-backs short, leaving the requests for whichever replica
        # drives the executor next to re-queue as lost. Taken before the close: a link task that
        # ends leaves the map at once, and must still be waited for while it hands back.
        pending = [*self._tasks, *self._link_tasks.values()]
        await asyncio.gather(*(link.close() for link in list(self.links.values())), return_exceptions=True)
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=timeout)
            for task in stuck:
                task.cancel()
            if stuck:
                log.warning("%d dispatcher tasks did not stop within %.1f s", len(stuck), timeout)

    def wake(self, queue_moved: bool = True) -> None:
        """Plan again now. ``queue_moved``: the queue may hold new work (a submit here, a
        hand-back, another replica's word); False when only room moved (a request finished), which
        a queue found empty cannot use, so the round then makes no round trip."""
        self._queue_moved |= queue_moved
        self._wake.set()

    def work_queued(self) -> None:
        """Work was queued (a submit, a hand-back): plan here now, and tell the other replicas."""
        self.wake()
        self.control.wake_others()

    async def alive_executors(self) -> int:
        """Executors driven here, or when none, those registered in Redis (a replica just started)."""
        return len(self.links) or await self.store.fleet.count()

    # ---- cancels -----------------------------------------------------------------------
    async def request_abort(self, request_id: str, executor_id: str) -> None:
        """Abort a running request on its executor, wherever the replica driving it is."""
        if not self._abort_local(request_id, executor_id):
            payload = json.dumps({"abort": request_id, "executor": executor_id})
            await self.control.publish(payload)

    def _abort_local(self, request_id: str, executor_id: str) -> bool:
        link = self.links.get(executor_id)
        if link is None:
            return False
        link.abort(request_id)
        link.flush()
        return True

    async def _control_loop(self) -> None:
        while not self._stopping:
            try:
                async for payload in self.control.messages():
                    self._on_control(payload)
            except RedisError as exc:
                log.warning("control channel lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
            except Exception:  # a message redis-py cannot even decode (not UTF-8): it is lost, the loop is not
                log.exception("control channel: a message broke the subscription; resubscribing")
                await asyncio.sleep(0.5)

    def _on_control(self, payload: str) -> None:
        """One message of the control channel: an abort for an executor driven here, or a wake.
        Anyone with Redis access can publish there, so a message that does not parse is skipped."""
        try:
            data = json.loads(payload)
            if isinstance(data, dict) and "abort" in data:
                self._abort_local(str(data["abort"]), str(data.get("executor", "")))
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            log.warning("control channel: skipped a message that is not JSON: %.200r", payload)
        self.wake()

    # ---- discovery and leases ----------------------------------------------------------
    async def _discovery_loop(self) -> None:
        interval = self.config.distributed.discovery_interval_ms / 1000
        while not self._stopping:
            try:
                await self.discover_once()
            except RedisError as exc:
                log.warning("discovery failed: %s", exc)
            except Exception:  # a defect: the loop must outlive it, or no lease is renewed again
                log.exception("discovery round failed")
            await asyncio.sleep(interval)

    async def discover_once(self) -> None:
        dist = self.config.distributed
        fleet = self.store.fleet
        alive = set(await fleet.alive_since(int(time.time() * 1000) - dist.executor_timeout_ms))
        now = int(time.time() * 1000)
        silence = now - self._redis_answered_ms if self._redis_answered_ms else 0
        if silence > dist.heartbeat_interval_ms + 2 * dist.discovery_interval_ms:
            # Redis was away (or this replica stalled): every executor's heartbeat and every lease
            # may have lapsed with nobody at fault. Judge no heartbeat until executors had time to
            # beat again, or every running request would be re-queued and charged a migration.
            self._judge_heartbeats_from_ms = now + dist.executor_timeout_ms
            log.warning("discovery heard from Redis after %d ms; heartbeats judged again in %d ms", silence,
                        dist.executor_timeout_ms)  # fmt: skip
        self._redis_answered_ms = now
        judging = now >= self._judge_heartbeats_from_ms
        held = list(self.links)
        # A lease that lapsed and that no replica took since is taken again with the renewal, while
        # its executor is registered (``lease_scripts.RENEW_LEASES``).
        renewals = await fleet.renew_leases(held, self.replica_id, dist.lease_ttl_ms)
        for executor_id, renewed in zip(held, renewals, strict=True):
            if executor_id not in self._link_tasks:
                continue  # its link ended while the renewals were in flight
            if not renewed or (judging and executor_id not in alive):
                if await fleet.retired(executor_id):  # a clean stop: expected, no warning
                    log.info("executor %s stopped; dropping its link", executor_id)
                else:
                    why = "its heartbeat is stale" if renewed else "its lease was lost"
                    log.warning("dropping executor %s: %s", executor_id, why)
                self._link_tasks[executor_id].cancel()
        for executor_id in alive - set(self.links) - self._closing:
            if await fleet.take_lease(executor_id, self.replica_id, dist.lease_ttl_ms):
                address = await fleet.address_of(executor_id)
                if address:
                    self._start_link(executor_id, address)
                else:
                    await fleet.release_lease(executor_id, self.replica_id)
        if judging:
            await self._reap_dead(now - dist.executor_timeout_ms)
        # Heard from Redis to the end of the round: a round slow of its own (reaping, hand-backs)
        # is no silence of Redis's. A round that failed leaves the stamp where its last success put it.
        self._redis_answered_ms = int(time.time() * 1000)

    async def refresh_signals(self) -> None:
        """Feed the scorer the executors' heartbeat load and the shared length estimator."""
        loads = await self.store.fleet.loads(await self.store.fleet.registered())
        self.scorer.update(loads, await self.store.queue.estimator_fields())
        self.metrics.load_factor.set(self.scorer.load_factor)
        self.metrics.length_error.set(self.scorer.mean_abs_error())

    async def _reap_dead(self, cutoff_ms: int) -> None:
        """Re-queue the requests of executors whose heartbeat stopped, once, under their lease."""
        fleet = self.store.fleet
        for executor_id in await fleet.silent_since(cutoff_ms):
            if executor_id in self.links or executor_id in self._closing:
                continue
            if not await fleet.take_lease(executor_id, self.replica_id, self.config.distributed.lease_ttl_ms):
                continue
            kind = HANDOVER if await fleet.retired(executor_id) else MIGRATE
            for request_id in await self.store.requests.running_ids(executor_id):
                await self.store.requests.hand_back(request_id, executor_id, kind, owner="")
                self.metrics.migrations.inc()
            await self.store.prefixes.drop(executor_id, self.replica_id)  # its cache died with it
            await fleet.forget(executor_id)
            await fleet.release_lease(executor_id, self.replica_id)
            log.warning("executor %s is gone; its requests were re-queued", executor_id)
            self._wake_for(requeued=True)

    def _start_link(self, executor_id: str, address: str) -> None:
        if self._stopping:
            return
        link = ExecutorLink(
            executor_id,
            address,
            self.store,
            self.config.scheduler,
            self.wake,
            self.config.distributed.redis_retry_s,
            self.config.security,
            self.metrics,
            (self.config.distributed.stream_interval_tokens, self.config.distributed.stream_interval_ms),
            self.replica_id,
        )
        self.links[executor_id] = link
        self._link_tasks[executor_id] = asyncio.create_task(self._drive(link), name=f"link-{executor_id}")

    async def _drive(self, link: ExecutorLink) -> None:
        executor_id = link.executor_id
        try:
            await link.connect()
            # Whatever Redis says runs there is stale for this new stream: abort it there (fenced
            # before it is re-queued, so no re-admission can overtake the abort), re-queue it here.
            stale = await self.store.requests.running_ids(executor_id)
            link.fence(stale)
            for request_id in stale:
                await self.store.requests.hand_back(request_id, executor_id, MIGRATE, owner="")
                self.metrics.migrations.inc()
            log.info("driving executor %s at %s", executor_id, link.address)
            self._wake_for(requeued=bool(stale))
            await link.run()
            log.warning("executor %s closed its stream", executor_id)
        except asyncio.CancelledError:
            pass
        except grpc.aio.AioRpcError as exc:  # its status, not grpc's many-line debug text
            log.warning("link to executor %s failed: %s %s", executor_id, exc.code().name, exc.details())
        except Exception as exc:
            log.warning("link to executor %s failed: %s", executor_id, exc)
        finally:
            self._closing.add(executor_id)
            self.links.pop(executor_id, None)
            self.metrics.forget_executor(executor_id)
            self._link_tasks.pop(executor_id, None)
            try:
                with contextlib.suppress(Exception):
                    await link.close()
                orphans = list(link.requests)
                with contextlib.suppress(RedisError):
                    # A planned stop, this replica's or the executor's, moves its requests without
                    # spending their migration budget, which is there for failures.
                    planned = bool(orphans) and (self._stopping or await self.store.fleet.retired(executor_id))
                    for request_id in orphans:
                        await link.hand_back(request_id, HANDOVER if planned else MIGRATE)
                        self.metrics.migrations.inc()
                    # Its events stop here: forget its index (unless another replica drives it now),
                    # so nothing is placed on blocks it may evict; the next link rebuilds it.
                    await self.store.prefixes.drop(executor_id, self.replica_id)
                    await self.store.fleet.release_lease(executor_id, self.replica_id)
            finally:
                self._closing.discard(executor_id)
            self._wake_for(requeued=bool(orphans))

    def _wake_for(self, requeued: bool) -> None:
        """Plan again; when work an executor lost went back to the queue, tell the other replicas
        too, which may have the room for it (this one may have no executor left)."""
        if requeued:
            self.work_queued()
        else:
            self.wake()

    # ---- admission -----------------------------------------------------------------------
    async def _planning_loop(self) -> None:
        while not self._stopping:
            # Ticks re-plan what time changes; with the queue known empty, nothing does until its
            # recheck: an idle replica then wakes 4 times a second rather than 20.
            tick = max(_PLAN_TICK_S, self.admission.idle_wait_s())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)
            queue_moved, self._queue_moved = self._queue_moved, False
            self._wake.clear()
            try:
                await self.plan_once(queue_moved)
                await self.refresh_queue_gauges()
            except RedisError as exc:
                log.warning("planning failed: %s", exc)
                await asyncio.sleep(0.2)
            except Exception:  # a defect: the loop must outlive it, or nothing is admitted again
                log.exception("planning round failed")
                await asyncio.sleep(0.2)

    async def plan_once(self, queue_moved: bool = True) -> int:
        """Admit what fits now; return how many requests were admitted. ``queue_moved``: a wake
        since the last round said the queue may hold new work (see ``wake``)."""
        started = time.perf_counter()
        admitted = await self.admission.run(list(self.links.values()), queue_moved)
        self.metrics.plan_latency.observe(time.perf_counter() - started)
        self.metrics.executors.set(len(self.links))
        self.metrics.running.set(sum(len(link.requests) for link in self.links.values()))
        return admitted

    async def refresh_queue_gauges(self, sample: int = 1000, every_s: float = 1.0) -> None:
        """Queue depth every tick; the fleet's load, the estimator and the queue by priority and
        tenant (over the queue's head) at most every ``every_s``. The depth the round's own read
        gave, less what it admitted, costs no round trip; a queue that admission just found empty,
        with nothing new since, is not read again: an idle replica then makes no round trip per
        tick."""
        if self.admission.queue_length is not None:  # the round just read it
            self.metrics.waiting.set(self.admission.queue_length)
        elif not self.admission.queue_known_empty:
            self.metrics.waiting.set(await self.store.queue.length())
        else:
            self.metrics.waiting.set(0)
        now = time.monotonic()
        if now - self._classes_refreshed < every_s:
            return
        self._classes_refreshed = now
        await self.refresh_signals()
        classes = await self.store.queue.classes(sample)  # read first: a scrape never sees none
        self.metrics.waiting_by.clear()
        for (priority, tenant), count in classes.items():
            self.metrics.waiting_by.labels(priority, tenant).set(count)
