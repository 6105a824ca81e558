"""One admission round: which queued requests join which executors' batches, and whom to preempt.

The steps, each a pure function elsewhere:
1. ``fair_share.fair_order``: the waiting tenants' queue heads, interleaved by virtual token counters
   (a request's later samples wait for its sample 0's prefill, see ``samples``).
2. ``batching``: hold a first batch at low load (``batch_timeout_ms``); length-aware reordering.
3. ``placement.place``: each request to the executor with the least expected work, less the
   prefill its prefix cache saves (from the fleet's prefix-cache index), capacities shrunk under
   load (``load_aware.min_admission_fraction``); a later sample to its sample 0's executor.
4. ``preemption.choose_victims``: when the head fits nowhere, evict running work it outranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from common.config import BatonConfig
from common.lifecycle import FinishReason
from scheduler_service.batching import merge_order, should_hold
from scheduler_service.executor_link import ExecutorLink
from scheduler_service.fair_share import QueuedRequest, fair_order
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.placement import Candidate, Placement, place, request_kv_blocks, unplaceable
from scheduler_service.preemption import choose_victims
from scheduler_service.samples import affinity, may_place
from scheduler_service.scoring import RequestScorer
from scheduler_service.store import Store
from scheduler_service.store.prefix_index import CachedRuns
from scheduler_service.store.queue import MalformedRecord
from scheduler_service.store.request_records import MALFORMED_FIELDS

log = logging.getLogger(__name__)

_MAX_TENANTS = 64  # waiting tenants considered per round: those with the smallest counters (ties drawn)
_MAX_CANDIDATES = 256
# Most prompts, and about most block names, whose cached prefixes the round's queue read looks up
# (a prompt of 512 tokens names 32 blocks): past them (a burst into an idle fleet with many free
# slots, many executors, long prompts) the rest are looked up in a round trip of their own, a
# script per prompt, so no call holds Redis for long.
_MAX_PREFIX_LOOKUPS = 64
_MAX_PREFIX_NAMES = 4_096
_PREEMPT_CHECK_S = 0.05
# A queue found empty is read again on a wake that says the queue moved, or after this long
# without one: those wakes (submits here, hand-backs, other replicas' submits) cover every way
# work arrives that this replica should see at once; the recheck covers a wake lost with a
# pub/sub connection, and work another replica hands back.
_EMPTY_RECHECK_S = 0.25


class Admission:
    def __init__(self, store: Store, config: BatonConfig, scorer: RequestScorer, metrics: SchedulerMetrics) -> None:
        self.store = store
        self.config = config
        self.scorer = scorer
        self.metrics = metrics
        self._preempt_checked = 0.0
        # The request a preemption made room for: it goes first until it is placed, so the room
        # is not taken by someone else (the victim itself, say) and the eviction wasted.
        self._promised: QueuedRequest | None = None
        # Claims that may be recorded in Redis with no link running them: made for a link that
        # closed while they were in flight, or sent in a round whose reply Redis never gave.
        self._unsettled: list[tuple[str, ExecutorLink]] = []
        self._found_empty_at: float | None = None  # when the last read found no waiting tenant
        self._rotation = 0  # where placement's ties start: moved on by every placement
        # The pending queue's length as the last round read it (None: this round did not read it).
        self.queue_length: int | None = None
        self._runs: dict[str, CachedRuns] = {}  # what the round's read said each head's prompt has cached

    @property
    def queue_known_empty(self) -> bool:
        """The last read found the queue empty, and no wake or recheck time has come since."""
        found = self._found_empty_at
        return found is not None and time.monotonic() - found < _EMPTY_RECHECK_S

    def idle_wait_s(self) -> float:
        """How long the planner may sleep without a wake: until the empty queue's recheck is due,
        or 0 while anything waits on time (a queue not known empty: aging, deadlines, held
        batches, preemption checks; claims to settle)."""
        found = self._found_empty_at
        if found is None or self._unsettled:
            return 0.0
        return max(0.0, _EMPTY_RECHECK_S - (time.monotonic() - found))

    async def run(self, links: Sequence[ExecutorLink], queue_moved: bool = True) -> int:
        """Admit what fits now; return how many requests were admitted. Without ``queue_moved``,
        a queue known to be empty is not read: an idle tick, or a finish that only freed room,
        costs no round trip."""
        self.queue_length = None
        if queue_moved:
            self._found_empty_at = None
        if self._unsettled:
            await self._settle()
        links = [link for link in links if link.ready]
        if not links or self.queue_known_empty:
            return 0  # nothing to admit, and so no one to preempt for
        # Room a preemption made is whole room: the victims were chosen against it, and shrunk by
        # the load, it would not fit the request they made way for (the queue would stall behind it).
        fraction = (
            1.0 if self._promised is not None else self._scaled(self.config.scheduler.load_aware.min_admission_fraction)
        )
        capacities = [link.capacity(fraction) for link in links]
        room = sum(c.free_slots for c in capacities if c.free_blocks > 0)
        if room == 0:
            # Saturated: only a preemption could admit anything. Look at most every 50 ms, and
            # only when some running request could be a victim, so steps cost no round trip.
            if time.monotonic() - self._preempt_checked < _PREEMPT_CHECK_S or not self._could_preempt(links):
                return 0
            self._preempt_checked = time.monotonic()
        # Executors that cache prefixes and have room, by block size: what placement asks about.
        caching = {
            link.executor_id: cap.block_size
            for link, cap in zip(links, capacities, strict=True)
            if cap.free_slots > 0 and cap.free_blocks > 0 and link.info is not None and link.info.prefix_caching
        }
        limit = min(_MAX_CANDIDATES, 2 * max(room, 1))
        ordered = await self._with_promise(await self.candidates(limit, list(caching), room))
        if not ordered:
            return 0
        running = sum(len(link.requests) for link in links)
        oldest_wait = time.time() * 1000 - min(r.arrival_ms for r in ordered)
        if should_hold(running, len(ordered), oldest_wait, self.scorer.load_factor, self.config.scheduler.batch_level):
            return 0
        remaining = [r.remaining for link in links for r in link.requests.values()]
        ordered = merge_order(ordered, remaining, self.config.scheduler.batch_level.merge_window_ms)
        candidates = [
            Candidate(r.request_id, r.num_tokens, r.num_tokens + r.expected_output, affinity=r.affinity)
            for r in ordered
        ]
        too_large = set(unplaceable(candidates, capacities))
        if too_large:
            for request_id in await self._held_nowhere(candidates, too_large, links):
                await self._fail_unplaceable(request_id)
            candidates = [c for c in candidates if c.request_id not in too_large]
        by_id = {link.executor_id: link for link in links}
        placements: list[Placement] = []
        if room:
            candidates = await self._with_cached_prefixes(candidates[:room], caching) + candidates[room:]
            marked = any(c.marks for c in candidates)  # without marks no candidate shares a placed prompt
            in_flight = {link.executor_id: link.placed_marks() for link in links} if marked else {}
            placements = place(candidates, capacities, self._rotation, in_flight)
            self._rotation += len(placements)
        admitted = 0
        claims = [(p.request_id, p.executor_id, by_id[p.executor_id].owner) for p in placements]
        for p in placements:
            by_id[p.executor_id].claiming.add(p.request_id)
        try:
            results = await self.store.requests.claim_many(
                claims, self.config.scheduler.request_level.tenant_max_running
            )
        except Exception:  # Redis's error, or a defect: either way settled next round, not left claiming
            self._unsettled += [(p.request_id, by_id[p.executor_id]) for p in placements]
            raise
        for placement, claimed in zip(placements, results, strict=True):
            link = by_id[placement.executor_id]
            if claimed is not None and (link.closed or not link.ready):
                # The link closed, or fenced itself (an abort it sent for this very request, maybe,
                # whose CANCELLED would end the new claim) while the claim was out: give it back.
                self._unsettled.append((claimed.request_id, link))
                continue
            link.claiming.discard(placement.request_id)
            if claimed is not None:
                link.admit(claimed, placement.cached_tokens, placement.marks)
                admitted += 1
        if self._unsettled:
            await self._settle()
        placed = {p.request_id for p in placements}
        if self._promised is not None and self._promised.request_id in placed:
            self._promised = None
        head = next((r for r in ordered if r.request_id not in too_large), None)
        if head is not None and head.request_id not in placed and self._promised is None:
            self._preempt_for(head, links)
        budget = self._scaled(self.config.scheduler.load_aware.min_token_budget_fraction)
        for link in links:
            link.flush(budget)
        if self.queue_length is not None:
            self.queue_length = max(0, self.queue_length - admitted)
        return admitted

    async def _with_cached_prefixes(self, candidates: list[Candidate], caching: Mapping[str, int]) -> list[Candidate]:
        """``candidates`` with how much of each one's prompt each executor in ``caching`` (those
        that cache prefixes and have room, by block size) holds. The round's queue read brought
        this for the heads placement can place; any other candidate (a promised request, one
        behind a sample still waiting) costs one more round trip. An executor whose block size
        differs from the one the prompt's names were computed with names other blocks, so it
        holds none of them.
        """
        if not caching or not candidates:
            return candidates
        missing = [c.request_id for c in candidates if c.request_id not in self._runs]
        if missing:
            looked_up = await self.store.prefixes.leading_runs(missing, list(caching))
            self._runs.update(zip(missing, looked_up, strict=True))
        out = []
        for cand in candidates:
            run = self._runs[cand.request_id]
            cached = {
                eid: blocks * run.block_size
                for eid, blocks in run.blocks.items()
                if blocks and caching.get(eid) == run.block_size
            }
            out.append(replace(cand, cached_tokens=cached, marks=run.marks, marks_block_size=run.block_size))
        return out

    async def _settle(self) -> None:
        """Hand back each unsettled claim that no open link runs.

        Without this such a request would stay ASSIGNED for good: its executor is alive, so
        nothing reaps it, and the executor's next driver may have looked for stale work before
        the claim landed. The owner check makes the hand-back a no-op for a claim Redis never
        applied. (Seen in the Redis-restart failover test: a round that began before the outage
        claimed the re-queued requests for the link the outage had just closed.)
        """
        while self._unsettled:
            request_id, link = self._unsettled[-1]
            if link.closed or request_id not in link.requests:
                # Nothing ran it, so it spends none of its migrations or preemptions.
                await self.store.requests.hand_back(request_id, link.executor_id, "unclaim", link.owner)
                self._found_empty_at = None  # it may be queued again
                log.info("request %s: a claim for %s reached no executor; handed back", request_id, link.executor_id)
            link.claiming.discard(request_id)
            self._unsettled.pop()

    def _scaled(self, minimum: float) -> float:
        """1 at low load, ``minimum`` at high load, linear between."""
        return 1.0 - (1.0 - minimum) * self.scorer.load_factor

    async def candidates(
        self, limit: int, prefix_executors: Sequence[str] = (), prefix_heads: int = 0
    ) -> list[QueuedRequest]:
        """Up to ``limit`` queued requests in fair order: O(T log n) for T waiting tenants, in one
        round trip. The same read asks how much of each tenant's first ``prefix_heads`` prompts
        each of ``prefix_executors`` caches (kept for ``_with_cached_prefixes``)."""
        read_at = time.monotonic()
        caps = self.config.scheduler.request_level.tenant_max_running
        # A fair round takes about limit / T from each tenant; a little more covers uneven
        # counters, and anything left over is simply read next round. This keeps a round's
        # reads near ``limit`` whatever the number of waiting tenants.
        view = await self.store.queue.admission_view(
            _MAX_TENANTS,
            limit,
            bool(caps),
            prefix_executors,
            prefix_heads,
            _MAX_PREFIX_LOOKUPS,
            _MAX_PREFIX_NAMES,
            caps=caps,
        )
        self.queue_length = view.queued
        self._runs = view.runs
        # No waiting tenant and nothing queued (tenants all at their caps are left out, yet wait).
        self._found_empty_at = None if view.counters or view.queued else read_at
        if not view.counters:
            return []
        heads: dict[str, list[QueuedRequest]] = {}
        for tenant, rows in view.heads.items():
            heads[tenant] = []
            for rid, score in rows:
                if _waits_for_first_sample(view.details[rid]):
                    continue
                queued = await self._parsed(rid, tenant, score, view.details[rid])
                if queued is not None:
                    heads[tenant].append(queued)
        credit = self.config.scheduler.request_level.fairness_priority_credit_tokens
        return fair_order(heads, view.counters, limit, view.running, caps, credit)

    async def _parsed(
        self, request_id: str, tenant: str, score: float, details: dict[str, str] | MalformedRecord | None
    ) -> QueuedRequest | None:
        """The queued request, or None: gone meanwhile, or malformed (then it ends FAILED here, so
        one bad record never stops a planning pass)."""
        if details is None:
            return None
        try:
            if isinstance(details, MalformedRecord):
                raise ValueError(details.reason)
            return _queued(request_id, tenant, score, details)
        except MALFORMED_FIELDS as e:
            await self.store.requests.quarantine(request_id, f"its record in Redis is malformed ({e})", tenant=tenant)
            return None

    async def _with_promise(self, ordered: list[QueuedRequest]) -> list[QueuedRequest]:
        """``ordered`` with the promised request first, while it is still queued."""
        promised = self._promised
        if promised is None:
            return ordered
        (details,) = await self.store.queue.queued_details([promised.request_id])
        if not isinstance(details, dict) or await self.store.queue.position(promised.request_id) is None:
            self._promised = None  # placed elsewhere, cancelled or finished meanwhile
            return ordered
        return [promised, *(r for r in ordered if r.request_id != promised.request_id)]

    def _could_preempt(self, links: Sequence[ExecutorLink]) -> bool:
        """Whether any running request could be a victim of even the most important arrival."""
        rl = self.config.scheduler.request_level
        if rl.preempt_priority_gap <= 0:
            return False
        floor = rl.max_priority - rl.preempt_priority_gap
        return any(
            r.priority <= floor and r.preemptions < rl.max_preemptions for link in links for r in link.requests.values()
        )

    def _preempt_for(self, head: QueuedRequest, links: Sequence[ExecutorLink]) -> None:
        rl = self.config.scheduler.request_level
        if rl.preempt_priority_gap <= 0 or any(link.preempting for link in links):
            return  # one eviction at a time: the next round sees the room it made
        best: tuple[int, ExecutorLink, list[str]] | None = None
        for link in links:
            cap = link.capacity()
            need = cap.request_kv_blocks(head.num_tokens)
            victims = choose_victims(
                head.priority,
                need,
                cap.free_blocks,
                cap.free_slots,
                link.running_requests(),
                rl.preempt_priority_gap,
                rl.max_preemptions,
            )
            if victims and (best is None or len(victims) < best[0]):
                best = (len(victims), link, victims)
        if best is not None:
            _, link, victims = best
            log.info(
                "preempting %s on %s for %s (priority %d)", victims, link.executor_id, head.request_id, head.priority
            )
            link.preempt(victims)
            self._promised = head
            self.metrics.scheduler_preemptions.inc(len(victims))

    async def _held_nowhere(
        self, candidates: Sequence[Candidate], too_large: set[str], links: Sequence[ExecutorLink]
    ) -> list[str]:
        """Of the candidates in ``too_large`` (more KV than any executor driven here has), those no
        live executor of the fleet could hold either. The others stay queued for the replica that
        drives the executor that can hold them (or for this one, once its link to it is ready)."""
        dist = self.config.distributed
        here = {link.executor_id for link in links}
        alive = await self.store.fleet.alive_since(time.time() * 1000 - dist.executor_timeout_ms)
        others = [executor_id for executor_id in alive if executor_id not in here]
        kv = await self.store.fleet.kv_capacities(others)
        known = [c for c in kv if c is not None]
        if len(known) < len(kv) or any(window > 0 for _, _, window in known):
            return []  # one that does not say, or that releases the blocks its window has passed
        return [
            cand.request_id
            for cand in candidates
            if cand.request_id in too_large
            and all(request_kv_blocks(cand.num_tokens, size) > total for total, size, _ in known)
        ]

    async def _fail_unplaceable(self, request_id: str) -> None:
        event = await self.store.requests.final_event(request_id, FinishReason.ERROR)
        error = "the request needs more KV cache than any executor has"
        # Only while it is queued: another replica may have placed it meanwhile.
        if await self.store.requests.finish_now(request_id, "", event, error, only_if="QUEUED"):
            log.warning("request %s failed: %s", request_id, error)


def _waits_for_first_sample(details: dict[str, str] | MalformedRecord | None) -> bool:
    """A later sample of a request whose sample 0 has not finished its prefill: it waits, to reuse
    the prompt's blocks (see ``samples``)."""
    if not isinstance(details, dict) or "first_state" not in details:
        return False
    return not may_place(details["first_state"] or None, int(details["first_generated"]))


def _queued(request_id: str, tenant: str, score: float, d: dict[str, str]) -> QueuedRequest:
    generated = int(d["generated"])
    expected = int(d["est_out"] or 0)
    return QueuedRequest(
        request_id=request_id,
        tenant=tenant,
        score=score,
        priority=int(d["priority"] or 0),
        num_tokens=int(d["prompt_len"]) + generated,
        expected_output=max(1, expected - generated),
        cost=float(d["fair_cost"] or 0.0),
        arrival_ms=int(d["arrival_ms"] or 0),
        affinity=affinity(d.get("first_state", ""), d.get("first_executor", "")),
    )
