"""Admission against a real redis-server: claims that no link would run are handed back.

The link here has no executor behind it (its plans only reach its outbox), which is all that
admission touches; the Redis side is real. The races are forced by wrapping the store's real
``claim_many``: the link closes, or the reply is lost, after Redis applied the claims.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from common.config import BatonConfig
from common.config_loading import with_overrides
from common.lifecycle import FinishReason
from common.pb import executor_pb2 as pb
from scheduler_service.admission import Admission
from scheduler_service.executor_link import ExecutorLink
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.requests import ClaimedRequest, TokenEvent
from scheduler_service.samples import sample_requests
from scheduler_service.scoring import RequestScorer
from scheduler_service.store import Store
from scheduler_service.store.step_publisher import StepWrite
from tests.scheduler_service.store_helpers import append, new_request

CONFIG = BatonConfig()


def open_link(store: Store, executor_id: str = "exec-1") -> ExecutorLink:
    link = ExecutorLink(executor_id, "127.0.0.1:1", store, CONFIG.scheduler, lambda _queue_moved: None)
    link.info = pb.InfoResponse(executor_id=executor_id, kv_blocks_total=100, block_size=16, max_batch_size=8)
    link.fence(())  # nothing stale on the executor: ready at once
    return link


async def queued(store: Store, scorer: RequestScorer, request_id: str) -> None:
    req = new_request(request_id)
    scored = scorer.score(req)
    await store.requests.enqueue(req, scored.score, 100, "", scored.fields)


@dataclass
class Round:
    """An admission, one open link, and request "r1" queued for it."""

    admission: Admission
    link: ExecutorLink


@pytest.fixture
async def round_(store: Store) -> Round:
    scorer = RequestScorer(CONFIG)
    await queued(store, scorer, "r1")
    return Round(Admission(store, CONFIG, scorer, SchedulerMetrics()), open_link(store))


def after_real_claims(store: Store, monkeypatch: pytest.MonkeyPatch, then: Callable[[], Awaitable[None]]) -> None:
    """Make ``claim_many`` apply the claims in Redis for real, then run ``then`` before it returns."""
    real_claim = store.requests.claim_many

    async def claim_then(
        claims: list[tuple[str, str, str]], caps: Mapping[str, int] | None = None
    ) -> list[ClaimedRequest | None]:
        rows = await real_claim(claims, caps)
        await then()
        return rows

    monkeypatch.setattr(store.requests, "claim_many", claim_then)


async def state_and_owner(store: Store, request_id: str) -> tuple[str, str]:
    record = await store.requests.get(request_id)
    assert record is not None
    return record["state"], record.get("owner", "")


async def test_a_claim_for_a_link_that_closed_meanwhile_goes_back_to_the_queue(
    store: Store, round_: Round, monkeypatch: pytest.MonkeyPatch
) -> None:
    admission, link = round_.admission, round_.link
    after_real_claims(store, monkeypatch, link.close)  # the link's stream ended while the claims were in flight
    assert await admission.run([link]) == 0
    assert "r1" not in link.requests
    assert await state_and_owner(store, "r1") == ("QUEUED", "")
    assert await store.queue.position("r1") == 0


async def test_claims_whose_reply_was_lost_are_settled_next_round(
    store: Store, round_: Round, monkeypatch: pytest.MonkeyPatch
) -> None:
    admission, link = round_.admission, round_.link
    real_claim = store.requests.claim_many

    async def lose_the_reply() -> None:
        raise RedisConnectionError("the connection dropped before the reply")

    after_real_claims(store, monkeypatch, lose_the_reply)
    with pytest.raises(RedisConnectionError):
        await admission.run([link])
    assert await state_and_owner(store, "r1") == ("ASSIGNED", link.owner)  # applied, yet nobody runs it
    assert "r1" not in link.requests
    monkeypatch.setattr(store.requests, "claim_many", real_claim)
    assert await admission.run([link]) == 1  # handed back first, then admitted for real
    assert "r1" in link.requests
    assert await state_and_owner(store, "r1") == ("ASSIGNED", link.owner)
    record = await store.requests.get("r1")
    assert record is not None and not record.get("migrations") and not record.get("preemptions")


async def test_settling_a_claim_redis_never_applied_changes_nothing(
    store: Store, round_: Round, monkeypatch: pytest.MonkeyPatch
) -> None:
    admission, link = round_.admission, round_.link

    async def fail_before_sending(
        claims: list[tuple[str, str, str]], caps: Mapping[str, int] | None = None
    ) -> list[ClaimedRequest | None]:
        raise RedisConnectionError("Redis is down")

    real_claim = store.requests.claim_many
    monkeypatch.setattr(store.requests, "claim_many", fail_before_sending)
    with pytest.raises(RedisConnectionError):
        await admission.run([link])
    monkeypatch.setattr(store.requests, "claim_many", real_claim)
    assert await admission.run([link]) == 1
    record = await store.requests.get("r1")
    assert record is not None and record["state"] == "ASSIGNED" and not record.get("migrations")


async def test_a_new_link_admits_nothing_until_its_stale_aborts_are_confirmed(store: Store) -> None:
    """The race a SIGKILLed replica's successor lost: it re-queued the executor's stale requests while
    its link already counted as ready, admission re-claimed one, and the admit went out ahead of the
    stale abort, which then cancelled the new run of it."""
    scorer = RequestScorer(CONFIG)
    await queued(store, scorer, "r1")
    admission = Admission(store, CONFIG, scorer, SchedulerMetrics())
    link = ExecutorLink("exec-1", "127.0.0.1:1", store, CONFIG.scheduler, lambda _queue_moved: None)
    link.info = pb.InfoResponse(executor_id="exec-1", kv_blocks_total=100, block_size=16, max_batch_size=8)
    assert not link.ready and await admission.run([link]) == 0, "connected, but not fenced yet"
    link.fence({"r1"})
    assert not link.ready and await admission.run([link]) == 0, "fenced, the aborts not confirmed yet"
    fence = cast(pb.Plan, link._outbox.get_nowait())  # None is only queued when the link closes
    assert list(fence.abort) == ["r1"] and not fence.admit, "the abort goes out first"
    await link._on_reports([pb.StepReport(plan_seq=fence.seq)])  # the executor applied it
    assert link.ready and await admission.run([link]) == 1
    link.flush()
    assert [a.request_id for a in link._outbox.get_nowait().admit] == ["r1"]


async def test_a_claim_that_lands_while_its_link_fences_goes_back_and_the_fences_cancel_spares_it(
    store: Store, round_: Round, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r1 runs on the link; another replica re-queues it (its lease lapsed); a round re-claims it
    for the same link while the link, its tokens refused, fences with an abort of r1. Admitted
    then, the abort's CANCELLED report would end the new claim: nobody cancelled it."""
    admission, link = round_.admission, round_.link
    assert await admission.run([link]) == 1
    link.flush()
    await store.requests.hand_back("r1", "exec-1", "migrate", owner="")  # the lease's new holder

    async def tokens_refused() -> None:
        await link._recover_refused([StepWrite("r1", TokenEvent(0, (5,), ""))], [False])

    real_claim = store.requests.claim_many
    after_real_claims(store, monkeypatch, tokens_refused)
    assert await admission.run([link]) == 0
    assert "r1" not in link.requests and await state_and_owner(store, "r1") == ("QUEUED", "")
    monkeypatch.setattr(store.requests, "claim_many", real_claim)
    plans = [cast(pb.Plan, link._outbox.get_nowait()) for _ in range(link._outbox.qsize())]
    fence = next(plan for plan in plans if list(plan.abort) == ["r1"])
    cancelled = pb.FinishedRequest(request_id="r1", finish_reason=FinishReason.CANCELLED.value)
    await link._on_reports([pb.StepReport(plan_seq=fence.seq, finished=[cancelled])])  # the abort's answer
    assert await state_and_owner(store, "r1") == ("QUEUED", "")
    assert link.ready and await admission.run([link]) == 1


async def test_a_queue_whose_every_tenant_is_at_its_cap_is_not_taken_for_empty(store: Store) -> None:
    """The read leaves out tenants at their cap; with every waiting tenant left out it names none,
    yet the queue holds their work: a finish (which only frees room) must read it again."""
    config = with_overrides(CONFIG, scheduler={"request_level": {"tenant_max_running": {"acme": 1}}})
    scorer = RequestScorer(config)
    await queued(store, scorer, "r1")
    await queued(store, scorer, "r2")
    admission = Admission(store, config, scorer, SchedulerMetrics())
    link = open_link(store)
    assert await admission.run([link]) == 1  # r1: acme is at its cap now
    assert await admission.run([link]) == 0
    assert not admission.queue_known_empty


async def test_a_queue_found_empty_is_read_again_only_when_the_queue_moved(store: Store, round_: Round) -> None:
    """A finish frees room but queues nothing, so the round it wakes does not read the queue."""
    admission, link = round_.admission, round_.link
    assert await admission.run([link]) == 1
    assert await admission.run([link]) == 0 and admission.queue_known_empty
    await queued(store, admission.scorer, "r2")  # no wake said so: only the recheck would see it
    assert await admission.run([link], queue_moved=False) == 0
    assert await admission.run([link], queue_moved=True) == 1 and "r2" in link.requests


async def test_a_link_says_whether_the_queue_moved_when_its_requests_leave(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    moves: list[bool] = []
    link = ExecutorLink("exec-1", "127.0.0.1:1", store, CONFIG.scheduler, moves.append)
    link.info = pb.InfoResponse(executor_id="exec-1", kv_blocks_total=100, block_size=16, max_batch_size=8)
    link.fence(())
    scorer = RequestScorer(CONFIG)
    for request_id in ("done", "evicted"):
        await queued(store, scorer, request_id)
        claimed = await store.requests.claim(request_id, "exec-1", link.owner)
        assert claimed is not None
        link.admit(claimed)
    finished = pb.FinishedRequest(request_id="done", finish_reason=FinishReason.LENGTH)
    last_token = pb.TokenDelta(request_id="done", token_ids=[7])
    await link._on_reports([pb.StepReport(tokens=[last_token], finished=[finished])])
    assert moves == [False], "a finish only freed room"
    await queued(store, scorer, "late")
    late = await store.requests.claim("late", "exec-1", link.owner)
    assert late is not None
    real_hand_back = store.requests.hand_back

    async def admit_meanwhile(*args: object, **kwargs: object) -> None:
        await real_hand_back(*args, **kwargs)  # type: ignore[arg-type]
        link.admit(late)  # the planner admits while the link writes: the count stays the same

    monkeypatch.setattr(store.requests, "hand_back", admit_meanwhile)
    await link._on_reports([pb.StepReport(preempted=["evicted"])])
    assert moves == [False, True], "a preempted request went back to the queue"
    assert await store.queue.position("evicted") == 0


async def test_later_samples_wait_for_the_first_samples_prefill_then_join_its_executor(store: Store) -> None:
    scorer = RequestScorer(CONFIG)
    admission = Admission(store, CONFIG, scorer, SchedulerMetrics())
    req = replace(new_request("m"), n=3)
    scored = scorer.score(req)
    await store.requests.enqueue_samples(sample_requests(req), scored.score, 100, "", scored.fields)
    links = [open_link(store, "exec-1"), open_link(store, "exec-2")]
    assert await admission.run(links) == 1, "sample 0 alone: the others wait for its prefill"
    (holder,) = [link for link in links if "m" in link.requests]
    assert await admission.run(links) == 0 and await store.queue.position("m~1") is not None
    assert await append(store, "m", holder.owner, 0, (5,)) == 1  # its first token: the prefill is done
    # The other executor is idle, yet both samples go where the prompt's blocks are.
    assert await admission.run(links, queue_moved=True) == 2
    assert set(holder.requests) == {"m", "m~1", "m~2"}


async def test_a_request_too_large_for_this_replicas_executors_waits_for_a_larger_one_elsewhere(
    store: Store,
) -> None:
    """A mixed fleet: the executor driven here has 100 blocks of 16 tokens, another replica's has
    1,000. A request of 2,000 tokens stays queued for that one; with no such executor alive it fails,
    and a request another replica claimed meanwhile is never failed here."""
    scorer = RequestScorer(CONFIG)
    admission, link = Admission(store, CONFIG, scorer, SchedulerMetrics()), open_link(store)
    big = replace(new_request("big"), prompt_ids=tuple(range(1, 2_001)))
    await store.requests.enqueue(big, scorer.score(big).score, 100, "", scorer.score(big).fields)
    now = int(time.time() * 1000)
    keys = store.keys
    for executor_id, blocks in (("exec-1", 100), ("exec-large", 1_000)):
        await store.redis.zadd(keys.executors, {executor_id: now})
        await store.redis.hset(keys.executor(executor_id), mapping={"kv_blocks_total": blocks, "block_size": 16})
    assert await admission.run([link]) == 0
    record = await store.requests.get("big")
    assert record is not None and record["state"] == "QUEUED"
    await store.redis.zadd(keys.executors, {"exec-large": 0})  # its heartbeat stopped
    assert await admission.run([link]) == 0
    record = await store.requests.get("big")
    assert record is not None and (record["state"], record["finish_reason"]) == ("FAILED", "ERROR")
    # Claimed elsewhere between the queue read and the fail: left running.
    await queued(store, scorer, "r2")
    assert await store.requests.claim("r2", "exec-large") is not None
    event = TokenEvent(0, (), "", FinishReason.ERROR, {})
    assert not await store.requests.finish_now("r2", "", event, "too large", only_if="QUEUED")
    record = await store.requests.get("r2")
    assert record is not None and record["state"] == "ASSIGNED"
