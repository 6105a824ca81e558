"""scheduler_service.samples, without a server: the samples' requests and seeds, when a later sample
may be placed and where, and the merged stream of their events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import pytest

from common.errors import InvalidRequest, NotFound
from common.lifecycle import FinishReason
from scheduler_service.requests import TokenEvent
from scheduler_service.samples import affinity, check_samples, may_place, merged_events, sample_requests, samples_of
from tests.scheduler_service.store_helpers import new_request


def test_samples_get_derived_ids_and_consecutive_seeds() -> None:
    req = replace(new_request("job"), n=3)
    samples = sample_requests(req)
    assert [s.request_id for s in samples] == ["job", "job~1", "job~2"]
    assert [s.params.seed for s in samples] == [3, 4, 5]
    assert [s.n for s in samples] == [3, 1, 1]
    assert all(s.prompt_ids == req.prompt_ids and s.tenant == req.tenant for s in samples)
    unseeded = replace(req, params=replace(req.params, seed=None))
    assert [s.params.seed for s in sample_requests(unseeded)] == [None, None, None]
    assert sample_requests(new_request("one")) == [new_request("one")]


def test_check_samples() -> None:
    assert check_samples(0, None, 8) == 1  # proto3's unset
    assert check_samples(8, 2**64 - 8, 8) == 8
    with pytest.raises(InvalidRequest, match="n must lie"):
        check_samples(9, None, 8)
    with pytest.raises(InvalidRequest, match="seed"):
        check_samples(2, 2**64 - 1, 8)


def test_samples_of_a_record() -> None:
    assert samples_of({"n": "4"}) == 4
    assert samples_of({}) == 1 and samples_of({"n": "junk"}) == 1


@pytest.mark.parametrize(
    ("state", "generated", "placeable"),
    [
        ("QUEUED", 0, False),
        ("ASSIGNED", 0, False),
        ("RUNNING", 0, False),  # re-admitted after a hand-back, no token yet
        ("RUNNING", 1, True),  # its prefill is done
        ("QUEUED", 3, True),  # preempted after its first token
        ("FINISHED", 1, True),
        ("CANCELLED", 0, True),
        ("FAILED", 0, True),
        (None, 0, True),  # its record is gone
    ],
)
def test_a_later_sample_waits_for_its_first_samples_prefill(state: str | None, generated: int, placeable: bool) -> None:
    assert may_place(state, generated) is placeable


def test_a_later_sample_is_drawn_to_where_its_first_sample_runs_or_ran() -> None:
    assert affinity("RUNNING", "exec-1") == "exec-1"
    assert affinity("FINISHED", "exec-1") == "exec-1"
    assert affinity("QUEUED", "") == "" and affinity("FAILED", "exec-1") == "" and affinity("", "") == ""


Follow = Callable[[str], AsyncIterator[TokenEvent]]


def _follower(script: dict[str, list[TokenEvent]], gate: asyncio.Event | None = None) -> tuple[list[str], Follow]:
    followed: list[str] = []

    async def follow(request_id: str) -> AsyncIterator[TokenEvent]:
        followed.append(request_id)
        if request_id not in script:
            raise NotFound(f"request {request_id} does not exist")
        for event in script[request_id]:
            if gate is not None and request_id == "r~1":
                await gate.wait()  # sample 1 lags behind
            yield event

    return followed, follow


def _events(*tokens: int, reason: FinishReason = FinishReason.LENGTH) -> list[TokenEvent]:
    return [
        TokenEvent(i, (t,), str(t), reason if i == len(tokens) - 1 else FinishReason.NONE) for i, t in enumerate(tokens)
    ]


async def test_merged_events_tag_each_sample_and_end_when_all_have_finished() -> None:
    gate = asyncio.Event()
    script = {"r": _events(1, 2), "r~1": _events(3, 4, reason=FinishReason.STOP), "r~2": _events(5)}
    followed, follow = _follower(script, gate)
    got: list[tuple[int, int]] = []
    async for k, event in merged_events(follow, "r", 3):
        got.extend((k, t) for t in event.token_ids)
        if len(got) == 3:
            gate.set()  # samples 0 and 2 have finished; sample 1 is still to come
    assert sorted(followed) == ["r", "r~1", "r~2"]
    assert got[:3] and {k for k, _ in got[:3]} == {0, 2}
    for k, sample in enumerate(["r", "r~1", "r~2"]):
        assert [t for j, t in got if j == k] == [t for e in script[sample] for t in e.token_ids]


async def test_merged_events_of_one_sample_are_the_requests_own() -> None:
    followed, follow = _follower({"solo": _events(7)})
    assert [(k, e.token_ids) async for k, e in merged_events(follow, "solo", 1)] == [(0, (7,))]
    assert followed == ["solo"]


async def test_a_followers_error_ends_the_merge_and_stops_the_others() -> None:
    never = asyncio.Event()
    script = {"r": _events(1, 2)}  # r~1 is missing: its follower fails

    async def follow(request_id: str) -> AsyncIterator[TokenEvent]:
        if request_id == "r":
            yield script["r"][0]
            await never.wait()  # sample 0 would go on for ever
        raise NotFound(request_id)

    with pytest.raises(NotFound, match="r~1"):
        async for _ in merged_events(follow, "r", 2):
            pass
    pending = [t for t in asyncio.all_tasks() if t.get_name().startswith("samples-r-")]
    assert all(t.done() for t in pending)
