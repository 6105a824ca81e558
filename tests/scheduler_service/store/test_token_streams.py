"""scheduler_service.store.token_streams against a real redis-server: entries appended in one round
trip, a final event starting the TTL, one malformed key failing only its own append, and reads."""

from __future__ import annotations

from redis.exceptions import ResponseError

from common.lifecycle import FinishReason
from scheduler_service.requests import TokenEvent
from scheduler_service.store import Store
from tests.scheduler_service.store_helpers import KEYS, TTL_S


def entry(request_id: str, event: TokenEvent) -> tuple[str, TokenEvent, dict[str, str]]:
    return request_id, event, event.to_fields()


async def test_append_all_then_read_back_in_order(store: Store) -> None:
    first, second = TokenEvent(0, (5, 6), "ab"), TokenEvent(2, (7,), "c")
    final = TokenEvent(3, (), "", FinishReason.STOP, {"prompt_tokens": 4, "completion_tokens": 3})
    replies = await store.streams.append_all([entry("r1", first), entry("r2", first), entry("r1", second)])
    assert all(isinstance(reply, str) for reply in replies)
    assert await store.redis.ttl(KEYS.output("r1")) == -1  # no TTL until the final event
    await store.streams.publish_final("r1", final)
    assert 0 < await store.redis.ttl(KEYS.output("r1")) <= TTL_S
    events = [event for _, event in await store.streams.read_events("r1", "0", block_ms=0)]
    assert events == [first, second, final]
    # Following from an entry id returns only what came after it.
    first_id = str(replies[0])
    assert [e for _, e in await store.streams.follow("r1", first_id, block_ms=10)] == [second, final]


async def test_a_malformed_stream_fails_only_its_own_append(store: Store) -> None:
    await store.redis.set(KEYS.output("bad"), "not a stream")
    event = TokenEvent(0, (1,), "x")
    replies = await store.streams.append_all([entry("ok1", event), entry("bad", event), entry("ok2", event)])
    assert isinstance(replies[0], str) and isinstance(replies[2], str)
    assert isinstance(replies[1], ResponseError)
    assert await store.streams.is_malformed("bad")
    assert not await store.streams.is_malformed("ok1")
    assert not await store.streams.is_malformed("never-written")
    await store.streams.drop("bad")
    assert not await store.streams.is_malformed("bad")


async def test_a_read_of_an_empty_stream_times_out_empty(store: Store) -> None:
    assert await store.streams.read_events("nothing", "0", block_ms=10) == []
    assert await store.streams.follow("nothing", "0", block_ms=10) == []
