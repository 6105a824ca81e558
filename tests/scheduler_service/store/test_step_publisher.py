"""Recording executor steps against a real redis-server: APPEND_TOKENS, FINISH and the RECORD_STEP
call of ``StepPublisher.publish``, and the events clients read back."""

from __future__ import annotations

import pytest

from common.lifecycle import FinishReason, RequestState
from scheduler_service.requests import TokenEvent
from scheduler_service.store import Store
from scheduler_service.store.step_publisher import StepWrite
from tests.scheduler_service.store_helpers import (
    KEYS,
    TTL_S,
    append,
    enqueue,
    finish,
    tokens_of,
)


async def test_append_tokens_records_them_and_moves_to_running(store: Store) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    assert await append(store, "r1", "e1", 0, (5, 6), "ab") == 2
    record = await store.requests.get("r1")
    assert record is not None
    assert record["state"] == "RUNNING"
    first_token_ms = record["first_token_ms"]
    assert int(first_token_ms) > 0
    assert await append(store, "r1", "e1", 2, (7,), "c") == 3
    record = await store.requests.get("r1")
    assert record is not None
    assert record["state"] == "RUNNING"
    assert record["first_token_ms"] == first_token_ms  # set once
    assert record["tokens_generated"] == "3"
    assert await tokens_of(store.redis, "r1") == ["5", "6", "7"]
    assert await store.streams.read_events("r1", "0", 10) == []  # recording publishes nothing: publish_step does


async def test_append_tokens_from_a_wrong_executor_is_rejected_without_changes(store: Store) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    assert await append(store, "r1", "e1", 0, (5,)) == 1
    before = await store.redis.hgetall(KEYS.request("r1"))
    assert await append(store, "r1", "intruder", 1, (6,)) == -1
    assert await store.redis.hgetall(KEYS.request("r1")) == before
    assert await tokens_of(store.redis, "r1") == ["5"]


async def test_append_tokens_to_a_queued_request_is_rejected(store: Store) -> None:
    await enqueue(store, "r1")
    assert await append(store, "r1", "", 0, (5,)) == -1
    assert await tokens_of(store.redis, "r1") == []
    record = await store.requests.get("r1")
    assert record is not None and record["state"] == "QUEUED"


@pytest.mark.parametrize("index", [0, 2, 5], ids=["replayed", "gap-of-one", "far-ahead"])
async def test_append_tokens_with_an_index_gap_is_rejected_without_changes(store: Store, index: int) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    assert await append(store, "r1", "e1", 0, (5,)) == 1
    before = await store.redis.hgetall(KEYS.request("r1"))
    assert await append(store, "r1", "e1", index, (6,)) == -2
    assert await store.redis.hgetall(KEYS.request("r1")) == before
    assert await tokens_of(store.redis, "r1") == ["5"]


@pytest.mark.parametrize(("executor_id", "index"), [("intruder", 1), ("e1", 5)], ids=["wrong-executor", "gap"])
async def test_rejected_append_publishes_no_event(store: Store, executor_id: str, index: int) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    assert (await store.steps.publish("e1", [StepWrite("r1", TokenEvent(0, (5,), ""))])).accepted == [True]
    refused = await store.steps.publish(executor_id, [StepWrite("r1", TokenEvent(index, (6,), ""))])
    assert refused.accepted == [False]
    events = [e for _, e in await store.streams.read_events("r1", "0", 10)]
    assert events == [TokenEvent(0, (5,), "")]


async def test_finish_sets_the_terminal_state_and_ttls(store: Store) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    await append(store, "r1", "e1", 0, (5, 6))
    assert await finish(store, "r1", "e1", FinishReason.STOP) == 1
    record = await store.requests.get("r1")
    assert record is not None
    assert record["state"] == "FINISHED"
    assert record["finish_reason"] == "STOP"
    assert int(record["finished_ms"]) > 0
    assert record["error"] == ""
    assert await store.requests.running_ids("e1") == set()
    for key in (KEYS.request("r1"), KEYS.tokens("r1")):
        assert 0 < await store.redis.ttl(key) <= TTL_S, key
    # Tokens survive the finish until the TTL.
    assert await tokens_of(store.redis, "r1") == ["5", "6"]


@pytest.mark.parametrize(
    ("reason", "state"),
    [
        (FinishReason.LENGTH, "FINISHED"),
        (FinishReason.CANCELLED, "CANCELLED"),
        (FinishReason.ERROR, "FAILED"),
    ],
)
async def test_finish_state_follows_the_reason(store: Store, reason: FinishReason, state: str) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    assert await finish(store, "r1", "e1", reason, error="boom" if reason is FinishReason.ERROR else "") == 1
    record = await store.requests.get("r1")
    assert record is not None
    assert record["state"] == state
    assert record["finish_reason"] == reason.name


async def test_finish_by_a_wrong_executor_or_twice_changes_nothing(store: Store) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    assert await finish(store, "r1", "intruder", FinishReason.STOP) == -1
    record = await store.requests.get("r1")
    assert record is not None and record["state"] == "ASSIGNED"
    assert await store.requests.running_ids("e1") == {"r1"}
    assert await finish(store, "r1", "e1", FinishReason.LENGTH) == 1
    assert await finish(store, "r1", "e1", FinishReason.ERROR) == 0
    record = await store.requests.get("r1")
    assert record is not None
    assert (record["state"], record["finish_reason"]) == ("FINISHED", "LENGTH")


async def test_finish_of_a_missing_request_returns_minus_one(store: Store) -> None:
    assert await finish(store, "ghost", "e1", FinishReason.STOP) == -1
    assert await store.requests.get("ghost") is None


async def test_finish_now_appends_the_final_event(store: Store) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    usage = {"prompt_tokens": 3.0, "completion_tokens": 0.0}
    await store.requests.finish_now("r1", "e1", TokenEvent(0, (), "", FinishReason.ERROR, usage), error="oom")
    record = await store.requests.get("r1")
    assert record is not None
    assert (record["state"], record["error"]) == ("FAILED", "oom")
    events = [e for _, e in await store.streams.read_events("r1", "0", 10)]
    assert events == [TokenEvent(0, (), "", FinishReason.ERROR, usage)]
    assert 0 < await store.redis.ttl(KEYS.output("r1")) <= TTL_S


async def test_read_events_returns_token_events_in_order_and_resumes_after_an_id(store: Store) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    usage = {"prompt_tokens": 3.0, "completion_tokens": 4.0}
    writes = [
        StepWrite("r1", TokenEvent(0, (1,), "a")),
        StepWrite("r1", TokenEvent(1, (2, 3), "bc")),
        StepWrite("r1", TokenEvent(3, (4,), "d", FinishReason.LENGTH, usage)),
    ]
    assert (await store.steps.publish("e1", writes)).accepted == [True, True, True]
    batch = await store.streams.read_events("r1", "0", 10)
    assert [e for _, e in batch] == [
        TokenEvent(0, (1,), "a"),
        TokenEvent(1, (2, 3), "bc"),
        TokenEvent(3, (4,), "d", FinishReason.LENGTH, usage),
    ]
    ids = [entry_id for entry_id, _ in batch]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    rest = await store.streams.read_events("r1", ids[0], 10)
    assert [e.index for _, e in rest] == [1, 3]
    assert await store.streams.read_events("r1", ids[-1], 10) == []


async def test_read_events_of_an_unknown_request_is_empty(store: Store) -> None:
    assert await store.streams.read_events("ghost", "0", 10) == []


async def test_a_retried_step_whose_first_attempt_landed_is_still_published(store: Store) -> None:
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    usage = {"prompt_tokens": 3.0, "completion_tokens": 2.0}
    # The first attempt recorded everything, then the connection died before the events went out.
    async with store.redis.pipeline(transaction=False) as pipe:
        await store.requests.append_tokens(pipe, "r1", "e1", TokenEvent(0, (5, 6), "ab"))
        await store.requests.finish(pipe, "r1", "e1", FinishReason.LENGTH)
        await pipe.execute()
    retry = [StepWrite("r1", TokenEvent(0, (5, 6), "ab", FinishReason.LENGTH, usage))]
    assert (await store.steps.publish("e1", retry)).accepted == [True]
    events = [e for _, e in await store.streams.read_events("r1", "0", 10)]
    assert events == [TokenEvent(0, (5, 6), "ab", FinishReason.LENGTH, usage)]
    # A different token at an already-filled position is still refused.
    await enqueue(store, "r2")
    await store.requests.claim("r2", "e1")
    assert await append(store, "r2", "e1", 0, (5,)) == 1
    assert await append(store, "r2", "e1", 0, (9,)) == -2


async def test_one_step_judges_each_request_on_its_own(store: Store) -> None:
    """publish_step records a whole step in one script call; each request keeps its own verdict."""
    for request_id in ("ok", "gap", "theirs", "done", "queued"):
        await enqueue(store, request_id)
    for request_id in ("ok", "gap", "done"):
        await store.requests.claim(request_id, "e1")
    await store.requests.claim("theirs", "e2")
    usage = {"prompt_tokens": 3.0, "completion_tokens": 2.0}
    writes = [
        StepWrite("ok", TokenEvent(0, (5, 6), "ab")),
        StepWrite("gap", TokenEvent(2, (7,), "c")),  # position 0 is next: refused
        StepWrite("theirs", TokenEvent(0, (8,), "d")),  # another executor holds it
        StepWrite("done", TokenEvent(0, (9, 10), "ef", FinishReason.LENGTH, usage)),
        StepWrite("queued", TokenEvent(0, (11,), "g")),  # never assigned
    ]
    assert (await store.steps.publish("e1", writes)).accepted == [True, False, False, True, False]
    assert await tokens_of(store.redis, "ok") == ["5", "6"]
    assert await tokens_of(store.redis, "gap") == []
    assert await tokens_of(store.redis, "theirs") == []
    assert await tokens_of(store.redis, "done") == ["9", "10"]
    records = {rid: await store.requests.get(rid) or {} for rid in ("ok", "gap", "theirs", "done", "queued")}
    assert records["ok"]["state"] == "RUNNING" and records["ok"]["first_token_ms"]
    assert records["gap"]["state"] == "ASSIGNED" and "first_token_ms" not in records["gap"]
    assert records["theirs"]["state"] == "ASSIGNED"
    assert (records["done"]["state"], records["done"]["finish_reason"]) == ("FINISHED", "LENGTH")
    assert records["queued"]["state"] == "QUEUED"
    assert await store.requests.running_ids("e1") == {"ok", "gap"}
    assert [e for _, e in await store.streams.read_events("ok", "0", 10)] == [TokenEvent(0, (5, 6), "ab")]
    assert await store.streams.read_events("gap", "0", 10) == []
    assert await store.streams.read_events("theirs", "0", 10) == []
    # The same step again (a retry whose reply was lost): the exact replays are accepted once more.
    replay = [writes[0], writes[3]]
    assert (await store.steps.publish("e1", replay)).accepted == [True, True]
    assert await tokens_of(store.redis, "ok") == ["5", "6"]


async def test_the_cached_prompt_tokens_of_the_first_token_stay_with_the_request(store: Store) -> None:
    """What the admission that produced the first token found cached is kept: a preempted request
    resumed elsewhere reports its new admission's hits, which cover its output too, and they are not
    the prompt's."""
    await enqueue(store, "r1")
    claimed = await store.requests.claim("r1", "e1")
    assert claimed is not None and claimed.cached_prompt_tokens is None
    refused = await store.steps.publish("e1", [StepWrite("r1", TokenEvent(1, (5,), "a"), cached_tokens=4)])
    assert refused.accepted == [False]  # a refused write keeps nothing
    assert "cached_tokens" not in (await store.requests.get("r1") or {})
    first = StepWrite("r1", TokenEvent(0, (5,), "a"), cached_tokens=32)
    assert (await store.steps.publish("e1", [first])).accepted == [True]
    assert (await store.requests.get("r1") or {})["cached_tokens"] == "32"
    assert await store.requests.requeue("r1", "e1") == 1
    claimed = await store.requests.claim("r1", "e2")
    assert claimed is not None and claimed.cached_prompt_tokens == 32
    resumed = StepWrite("r1", TokenEvent(1, (6,), "b"), cached_tokens=48)
    assert (await store.steps.publish("e2", [resumed])).accepted == [True]
    assert (await store.requests.get("r1") or {})["cached_tokens"] == "32"


@pytest.mark.parametrize("tokens", [(7, 8), ()], ids=["with-tokens", "no-tokens"])
async def test_a_final_step_behind_the_record_ends_nothing(store: Store, tokens: tuple[int, ...]) -> None:
    """Redis holds fewer tokens than the executor made (its AOF's tail was lost): the request's
    last step is refused whole, so it is not ended with a hole in its output and no final event."""
    await enqueue(store, "r1")
    await store.requests.claim("r1", "e1")
    assert await append(store, "r1", "e1", 0, (5,)) == 1
    usage = {"prompt_tokens": 3.0, "completion_tokens": 4.0}
    final = StepWrite("r1", TokenEvent(3, tokens, "x", FinishReason.LENGTH, usage))
    assert (await store.steps.publish("e1", [final])).accepted == [False]
    record = await store.requests.get("r1")
    assert record is not None and record["state"] == "RUNNING"
    assert await tokens_of(store.redis, "r1") == ["5"]
    assert await store.streams.read_events("r1", "0", 10) == []
    # A cancel's final step is not held to the count: it ends the request whatever it holds.
    cancel = StepWrite("r1", TokenEvent(3, (), "", FinishReason.CANCELLED, usage))
    assert (await store.steps.publish("e1", [cancel])).accepted == [True]
    assert (await store.requests.get("r1") or {})["state"] == "CANCELLED"


async def test_a_step_names_the_requests_a_cancel_is_pending_for(store: Store) -> None:
    """CANCEL only flags a request that runs; its abort can miss the executor (it was being claimed
    just then), so the next step of it that Redis records says so, and the link aborts it then."""
    for rid in ("r1", "r2"):
        await enqueue(store, rid)
        await store.requests.claim(rid, "e1")
    assert (await store.requests.cancel("r1")).state is RequestState.ASSIGNED  # flagged, not ended
    writes = [StepWrite("r1", TokenEvent(0, (5,), "")), StepWrite("r2", TokenEvent(0, (6,), ""))]
    recorded = await store.steps.publish("e1", writes)
    assert recorded.accepted == [True, True] and recorded.cancel_pending == ["r1"]
    # Its executor aborted it: the final event ends it CANCELLED, and nothing is pending any more.
    usage = {"prompt_tokens": 1.0, "completion_tokens": 1.0}
    final = StepWrite("r1", TokenEvent(1, (), "", FinishReason.CANCELLED, usage))
    recorded = await store.steps.publish("e1", [final])
    assert recorded.accepted == [True] and recorded.cancel_pending == []
    assert (await store.requests.get("r1") or {})["state"] == "CANCELLED"
