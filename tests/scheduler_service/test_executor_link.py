"""The executor link against a real redis-server: what it does when Redis refuses a step or its index write."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from common.keys import KeySchema
from common.lifecycle import FinishReason
from common.pb import executor_pb2 as epb
from common.redis_client import connect
from common.sampling_params import SamplingParams
from scheduler_service.executor_link import ExecutorLink
from scheduler_service.requests import NewRequest
from scheduler_service.store import Store
from tests.stack import stack_config


async def enqueued(store: Store, request_id: str) -> None:
    """Queue a short greedy request ``request_id``."""
    await store.requests.enqueue(
        NewRequest(request_id, (1, 5, 6), SamplingParams(max_tokens=5, ignore_eos=True), 5, "t", 0, 0), 0.0, 100
    )


async def running_on_a_link(store: Store, redis_url: str, request_id: str, executor_id: str) -> ExecutorLink:
    """A link with no executor behind it, driving ``request_id`` (queued, claimed and admitted)."""
    await enqueued(store, request_id)
    link = ExecutorLink(
        executor_id, "unused:0", store, stack_config(redis_url, Path(".")).scheduler, lambda _queue_moved: None
    )
    claimed = await store.requests.claim(request_id, executor_id, link.owner)
    assert claimed is not None
    link.admit(claimed)
    return link


async def test_a_finish_redis_lost_is_found_by_the_orphan_check_and_re_queued(redis_url: str) -> None:
    """Redis restarted from an AOF missing its tail after a request's last step was recorded: its
    record is RUNNING here again with its tokens cut back, and the executor, done with it, will
    never report it. The link's orphan check re-queues it from what Redis kept; what the link still
    drives, and claims admission has made but not yet handed the link, are left alone."""
    client = connect(redis_url)
    try:
        keys = KeySchema()
        store = Store(client, keys, request_ttl_s=60)
        link = await running_on_a_link(store, redis_url, "lost", "exec-o")
        for request_id in ("driven", "claiming"):
            await enqueued(store, request_id)
        link.claiming.add("claiming")
        assert await store.requests.claim("claiming", "exec-o", link.owner) is not None
        driven = await store.requests.claim("driven", "exec-o", link.owner)
        assert driven is not None
        link.admit(driven)
        await link._on_reports([epb.StepReport(tokens=[epb.TokenDelta(request_id="lost", token_ids=[40], index=0)])])
        rewound = [keys.request("lost"), keys.tokens("lost"), keys.running("exec-o"), keys.tenant_running]
        snapshot = [await client.dump(key) for key in rewound]
        final = epb.StepReport(
            tokens=[epb.TokenDelta(request_id="lost", token_ids=[41], index=1)],
            finished=[epb.FinishedRequest(request_id="lost", finish_reason=FinishReason.LENGTH.value)],
        )
        await link._on_reports([final])
        assert (await store.requests.get("lost") or {})["state"] == "FINISHED"
        for key, dumped in zip(rewound, snapshot, strict=True):
            assert dumped is not None
            await client.restore(key, 0, dumped, replace=True)  # acknowledged, then lost with the AOF's tail

        await link.hand_back_orphans()
        record = await store.requests.get("lost") or {}
        # Nothing failed but Redis: neither a migration nor a preemption is charged.
        assert (record["state"], record.get("migrations"), record.get("preemptions")) == ("QUEUED", None, None)
        assert await store.requests.tokens_between("lost", 0, 5) == (40,)
        for request_id in ("driven", "claiming"):
            assert (await store.requests.get(request_id) or {})["state"] == "ASSIGNED"
        assert await store.requests.running_ids("exec-o") == {"driven", "claiming"}
        assert link._outbox.empty()  # the executor runs nothing the link does not drive: no abort
    finally:
        await client.aclose()


async def test_the_orphan_check_re_queues_another_links_claim_only_while_its_replica_holds_the_lease(
    redis_url: str,
) -> None:
    """A claim an older link made for this executor after this link swept what ran there, its
    hand-back lost with that link: nobody drives it. A link whose replica lost the executor's lease
    must leave it alone (the new driver may run it); the lease holder's link re-queues it."""
    client = connect(redis_url)
    try:
        keys = KeySchema()
        store = Store(client, keys, request_ttl_s=60)
        link = await running_on_a_link(store, redis_url, "mine", "exec-f")
        link.holder = "replica-a"
        await enqueued(store, "theirs")
        assert await store.requests.claim("theirs", "exec-f", "exec-f#older") is not None
        await client.set(keys.lease("exec-f"), "replica-b")

        await link.hand_back_orphans()  # not the lease holder: its hand-back could hit the new driver's work
        assert (await store.requests.get("theirs") or {})["state"] == "ASSIGNED"

        await client.set(keys.lease("exec-f"), "replica-a")
        await link.hand_back_orphans()
        assert (await store.requests.get("theirs") or {})["state"] == "QUEUED"
        assert await store.requests.running_ids("exec-f") == {"mine"}
        assert (await store.requests.get("mine") or {})["state"] == "ASSIGNED"
        assert link._outbox.empty()
    finally:
        await client.aclose()


async def test_a_final_step_refused_as_behind_re_queues_the_request(redis_url: str) -> None:
    """Redis restarted from an older AOF holds fewer tokens than the executor made, and the first
    step it sees after the restart is the request's last. That step must not end the request with
    a hole in its output and no final event: the link aborts it and re-queues it from Redis's record.
    """
    client = connect(redis_url)
    try:
        store = Store(client, KeySchema(), request_ttl_s=60)
        link = await running_on_a_link(store, redis_url, "behind", "exec-x")
        await link._on_reports([epb.StepReport(tokens=[epb.TokenDelta(request_id="behind", token_ids=[40], index=0)])])
        await link._on_reports(
            [epb.StepReport(tokens=[epb.TokenDelta(request_id="behind", token_ids=[41, 42], index=1)])]
        )
        await client.rpop(KeySchema().tokens("behind"), 2)  # acknowledged, then lost with the AOF's tail
        final = epb.StepReport(
            tokens=[epb.TokenDelta(request_id="behind", token_ids=[43, 44], index=3)],
            finished=[epb.FinishedRequest(request_id="behind", finish_reason=FinishReason.LENGTH.value)],
        )
        await link._on_reports([final])
        record = await store.requests.get("behind") or {}
        assert (record["state"], record.get("migrations")) == ("QUEUED", "1"), record
        assert await store.requests.tokens_between("behind", 0, 5) == (40,)
        events = [event for _, event in await store.streams.read_events("behind", "0", 100)]
        assert all(event.finish_reason is FinishReason.NONE for event in events), events
        assert "behind" not in link.requests
        abort = link._outbox.get_nowait()
        assert abort is not None and list(abort.abort) == ["behind"]
    finally:
        await client.aclose()


async def test_a_failed_index_write_ends_the_link_after_the_steps_tokens_are_recorded(redis_url: str) -> None:
    """A step's prefix-cache events go to Redis beside its tokens: when the index write fails (here
    the executor's set holds another type), the tokens are still recorded and the failure ends the
    link, whose next stream's first report rebuilds the set."""
    client = connect(redis_url)
    try:
        keys = KeySchema()
        store = Store(client, keys, request_ttl_s=60)
        link = await running_on_a_link(store, redis_url, "idx", "exec-i")
        await client.set(keys.cached_blocks("exec-i"), "not a set")
        step = epb.StepReport(
            tokens=[epb.TokenDelta(request_id="idx", token_ids=[40], index=0)],
            kv_events=epb.KvCacheEvents(stored=[7]),
        )
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await link._on_reports([step])
        assert await store.requests.tokens_between("idx", 0, 1) == (40,)
        assert [event.token_ids for _, event in await store.streams.read_events("idx", "0", 100)] == [(40,)]
    finally:
        await client.aclose()


async def test_a_hand_back_that_meets_a_redis_blip_is_retried_not_the_links_end(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor preempted a request and Redis dropped the connection as the link handed it
    back: the hand-back is tried again, and the link (with every other request on it) goes on."""
    client = connect(redis_url)
    try:
        store = Store(client, KeySchema(), request_ttl_s=60)
        link = await running_on_a_link(store, redis_url, "preempted", "exec-b")
        real_hand_back = store.requests.hand_back
        blips = [RedisConnectionError("connection reset by peer")]

        async def blip_once(*args: object, **kwargs: object) -> None:
            if blips:
                raise blips.pop()
            await real_hand_back(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(store.requests, "hand_back", blip_once)
        await link._on_reports([epb.StepReport(preempted=["preempted"])])
        assert not blips and "preempted" not in link.requests
        assert (await store.requests.get("preempted") or {})["state"] == "QUEUED"
    finally:
        await client.aclose()


async def test_a_pending_cancel_is_sent_to_the_executor_once(redis_url: str) -> None:
    """Every report until the executor applies the abort still carries the request's tokens, and
    Redis says the cancel is pending each time: the abort went out (and was logged) with each."""
    client = connect(redis_url)
    try:
        store = Store(client, KeySchema(), request_ttl_s=60)
        link = await running_on_a_link(store, redis_url, "leaving", "exec-c")
        link.info = epb.InfoResponse(max_batch_size=8, token_budget=64)
        link.flush()
        assert list(link._outbox.get_nowait().admit) and link._outbox.empty()  # type: ignore[union-attr]
        await store.requests.cancel("leaving")
        for index in range(3):
            delta = epb.TokenDelta(request_id="leaving", token_ids=[40 + index], index=index)
            await link._on_reports([epb.StepReport(tokens=[delta])])
        abort = link._outbox.get_nowait()
        assert abort is not None and list(abort.abort) == ["leaving"]
        assert link._outbox.empty()
    finally:
        await client.aclose()
