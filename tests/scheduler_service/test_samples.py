"""scheduler_service.samples, without a server: the samples' requests and seeds, when a later sample
may be placed and where, and the merged stream of their events; and the frontend's handling of a
request's samples against a real redis-server (no executor)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import cast

import pytest

from common.config import BatonConfig
from common.config_loading import with_overrides
from common.errors import InvalidRequest, NotFound
from common.lifecycle import FinishReason, RequestState
from common.pb import generate_pb2 as pb
from scheduler_service.dispatcher import Dispatcher
from scheduler_service.frontend import Frontend
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.requests import TokenEvent
from scheduler_service.samples import affinity, check_samples, may_place, merged_events, sample_requests, samples_of
from scheduler_service.scoring import RequestScorer
from scheduler_service.store import Store
from scheduler_service.tokenizer_source import ModelLimits, TokenizerSource
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
    assert check_samples(0, 8) == 1  # proto3's unset
    assert check_samples(8, 8) == 8
    with pytest.raises(InvalidRequest, match="n must lie"):
        check_samples(9, 8)


def test_sample_seeds_wrap_around_the_seed_range() -> None:
    # A negative seed reaches Baton in two's complement (-2 as 2**64 - 2): its samples take -2, -1,
    # 0, ... as vLLM's seed + k does, rather than being refused for leaving the range.
    req = replace(new_request("job"), n=3)
    req = replace(req, params=replace(req.params, seed=2**64 - 2))
    assert [s.params.seed for s in sample_requests(req)] == [2**64 - 2, 2**64 - 1, 0]


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


@dataclass
class _Tokenizers:
    async def get(self) -> tuple[object, ModelLimits]:
        return object(), ModelLimits("m", 4096, 1000, 16)


class _Dispatcher:
    def work_queued(self) -> None:
        pass


def _frontend(store: Store, **request_level: object) -> Frontend:
    config = (
        with_overrides(BatonConfig(), scheduler={"request_level": request_level}) if request_level else BatonConfig()
    )
    # The fakes stand in for the only parts of the two that submit, cancel and status call.
    return Frontend(
        store,
        cast(Dispatcher, _Dispatcher()),
        cast(TokenizerSource, _Tokenizers()),
        config,
        RequestScorer(config),
        SchedulerMetrics(),
    )


def _asking(request_id: str, n: int) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=4, n=n, seed=10, temperature=1.0)
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], params=params)


async def test_the_frontend_queues_describes_and_cancels_every_sample(store: Store) -> None:
    frontend = _frontend(store)
    req = await frontend.submit(_asking("front", 3))
    assert req.n == 3 and await frontend.samples("front") == 3 and await frontend.samples("front~2") == 1
    status = await frontend.status("front")
    assert [(s.request_id, s.sample_index, s.state) for s in status.samples] == [
        ("front", 0, RequestState.QUEUED),
        ("front~1", 1, RequestState.QUEUED),
        ("front~2", 2, RequestState.QUEUED),
    ]
    assert [s.queue_position for s in status.samples] == [0, 1, 2]
    assert (await frontend.status("front~1")).samples == ()
    assert await frontend.cancel("front") is RequestState.CANCELLED
    ends = [(k, e.finish_reason) async for k, e in frontend.sample_events("front", 3)]
    assert sorted(ends) == [(k, FinishReason.CANCELLED) for k in range(3)]
    assert await store.queue.length() == 0


async def test_samples_that_could_never_fit_the_queue_are_invalid(store: Store) -> None:
    frontend = _frontend(store, max_pending_requests=4, shed_reserve_fraction=0.5)
    with pytest.raises(InvalidRequest, match="exceed the queue's limit"):
        await frontend.submit(_asking("too-many", 4))  # priority 5's limit is 3 of 4
    assert await store.requests.get("too-many") is None
