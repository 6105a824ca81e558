"""Placement by cached prefix, end to end on the scheduler's side, against a real redis-server:
a link indexes its executor's cache events, admission sends a queued prompt to the executor that
holds its start and grants only the prefill left, and an executor's index goes when its link
ends or it dies. The links have no executor behind them (plans stay in their outboxes)."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import pytest

from common.block_hashing import block_hashes
from common.config import BatonConfig
from common.pb import executor_pb2 as pb
from scheduler_service.admission import Admission
from scheduler_service.dispatcher import Dispatcher
from scheduler_service.executor_link import ExecutorLink
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.prompt_prefix import name_text, prefix_fields
from scheduler_service.scoring import RequestScorer
from scheduler_service.store import Store
from scheduler_service.store.prefix_index import CacheEvents
from tests.scheduler_service.store_helpers import KEYS, new_request

CONFIG = BatonConfig()
BLOCK = 16
PROMPT = tuple(range(1, 101))  # six full blocks and four tokens


def open_link(store: Store, executor_id: str, caching: bool = True, block_size: int = BLOCK) -> ExecutorLink:
    link = ExecutorLink(executor_id, "127.0.0.1:1", store, CONFIG.scheduler, lambda _queue_moved: None)
    link.info = pb.InfoResponse(
        executor_id=executor_id, kv_blocks_total=100, block_size=block_size, max_batch_size=8, prefix_caching=caching
    )
    link.fence(())
    return link


async def queue(store: Store, request_id: str, prompt: tuple[int, ...] = PROMPT) -> None:
    req = new_request(request_id, prompt)
    scored = RequestScorer(CONFIG).score(req)
    await store.requests.enqueue(req, scored.score, 100, "", {**scored.fields, **prefix_fields(prompt, BLOCK)})


def cache_report(
    *, cleared: bool = False, stored: tuple[int, ...] = (), removed: tuple[int, ...] = ()
) -> pb.StepReport:
    return pb.StepReport(kv_events=pb.KvCacheEvents(cleared=cleared, stored=stored, removed=removed))


def admission(store: Store) -> Admission:
    return Admission(store, CONFIG, RequestScorer(CONFIG), SchedulerMetrics())


def sent_plan(link: ExecutorLink) -> pb.Plan:
    return cast(pb.Plan, link._outbox.get_nowait())  # None is only queued when the link closes


async def test_a_link_indexes_its_executors_cache_events_in_report_order(store: Store) -> None:
    link = open_link(store, "exec-1")
    await link._on_reports([cache_report(cleared=True, stored=(1, 2, 3))])
    await link._on_reports([cache_report(removed=(1,)), cache_report(stored=(1, 4)), cache_report(removed=(4,))])
    assert await store.redis.smembers(KEYS.cached_blocks("exec-1")) == {name_text(n) for n in (1, 2, 3)}
    await link._on_reports([cache_report(cleared=True, stored=(9,))])  # a new stream starts over
    assert await store.redis.smembers(KEYS.cached_blocks("exec-1")) == {name_text(9)}


async def test_a_queued_prompt_goes_where_its_prefix_is_cached_and_only_the_rest_is_granted(store: Store) -> None:
    links = [open_link(store, "exec-1"), open_link(store, "exec-2")]
    held = block_hashes(PROMPT, BLOCK)[:4]  # 64 of its 100 tokens
    await links[1]._on_reports([cache_report(cleared=True, stored=tuple(held))])
    await links[0]._on_reports([cache_report(cleared=True, stored=(12345,))])
    await queue(store, "r1")
    assert await admission(store).run(links) == 1
    assert "r1" in links[1].requests and not links[0].requests
    assert links[1].requests["r1"].cached_tokens == 64
    plan = sent_plan(links[1])
    assert [a.request_id for a in plan.admit] == ["r1"]
    assert [(g.request_id, g.num_tokens) for g in plan.prefill] == [("r1", len(PROMPT) - 64)]
    assert links[1].capacity().outstanding_tokens == links[1].requests["r1"].remaining + len(PROMPT) - 64


async def test_executors_that_do_not_cache_are_not_asked(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_lookups(*_args: object) -> None:
        raise AssertionError("no executor caches prefixes: nothing to look up")

    monkeypatch.setattr(store.prefixes, "leading_runs", no_lookups)
    link = open_link(store, "exec-1", caching=False)
    await queue(store, "r1")
    assert await admission(store).run([link]) == 1
    assert link.requests["r1"].cached_tokens == 0
    assert [g.num_tokens for g in sent_plan(link).prefill] == [len(PROMPT)]


async def test_the_rounds_queue_read_brings_the_cached_prefixes(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_lookups(*_args: object) -> None:
        raise AssertionError("the round's queue read brought them: no round trip of its own")

    monkeypatch.setattr(store.prefixes, "leading_runs", no_lookups)
    links = [open_link(store, "exec-1"), open_link(store, "exec-2")]
    await links[1]._on_reports([cache_report(cleared=True, stored=tuple(block_hashes(PROMPT, BLOCK)[:4]))])
    await queue(store, "r1")
    assert await admission(store).run(links) == 1
    assert links[1].requests["r1"].cached_tokens == 64


async def test_heads_past_the_reads_lookups_are_looked_up_in_one_more_call(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("scheduler_service.admission._MAX_PREFIX_LOOKUPS", 1)
    calls: list[list[str]] = []
    lookup = store.prefixes.leading_runs

    async def counted(request_ids: list[str], executor_ids: list[str]) -> object:
        calls.append(list(request_ids))
        return await lookup(request_ids, executor_ids)

    monkeypatch.setattr(store.prefixes, "leading_runs", counted)
    links = [open_link(store, "exec-1"), open_link(store, "exec-2")]
    await links[1]._on_reports([cache_report(cleared=True, stored=tuple(block_hashes(PROMPT, BLOCK)[:4]))])
    for rid in ("r1", "r2", "r3"):
        await queue(store, rid)
    assert await admission(store).run(links) == 3
    assert calls == [["r2", "r3"]]
    assert [links[1].requests[rid].cached_tokens for rid in ("r1", "r2")] == [64, 64]


async def test_names_made_with_another_block_size_hold_nothing(store: Store) -> None:
    link = open_link(store, "exec-1", block_size=32)
    await link._on_reports([cache_report(cleared=True, stored=tuple(block_hashes(PROMPT, BLOCK)))])
    await queue(store, "r1")
    assert await admission(store).run([link]) == 1
    assert link.requests["r1"].cached_tokens == 0


async def test_misses_on_an_idle_fleet_take_turns(store: Store) -> None:
    links = [open_link(store, f"exec-{i}") for i in range(3)]
    rounds = admission(store)
    chosen = []
    for i in range(3):
        await queue(store, f"r{i}", tuple(range(1000 + 100 * i, 1100 + 100 * i)))
        assert await rounds.run(links) == 1
        chosen += [link.executor_id for link in links if f"r{i}" in link.requests]
        for link in links:  # finished: the fleet is idle and equal again
            link.requests.clear()
    assert sorted(chosen) == ["exec-0", "exec-1", "exec-2"]


async def test_a_prefix_being_computed_counts_as_cached_where_it_was_placed(store: Store) -> None:
    """Nothing caches the prompt yet. In one round: the first request goes where the tie-break says
    and the second to the other executor, lighter by the first's work; the later ones are credited
    the shared blocks on both, in that round and the next, as long as no first token has come
    (then the fleet's index names those blocks). The grants count only what is left to compute."""
    links = [open_link(store, "exec-1"), open_link(store, "exec-2")]
    await links[0]._on_reports([cache_report(cleared=True, stored=(12345,))])  # both cache, neither this prompt
    await links[1]._on_reports([cache_report(cleared=True, stored=(67890,))])
    shared = PROMPT[:96]  # six full blocks: marks at blocks 1, 2 and 4
    for i in range(4):
        await queue(store, f"r{i}", (*shared, 5000 + i, 6000 + i))
    rounds = admission(store)
    assert await rounds.run(links) == 4
    where = {rid: link for link in links for rid in link.requests}
    assert where["r0"] is not where["r1"]
    cached = {rid: link.requests[rid].cached_tokens for rid, link in where.items()}
    assert cached == {"r0": 0, "r1": 0, "r2": 4 * BLOCK, "r3": 4 * BLOCK}
    grants = {g.request_id: g.num_tokens for link in links for g in sent_plan(link).prefill}
    assert grants == {"r0": 98, "r1": 98, "r2": 98 - 4 * BLOCK, "r3": 98 - 4 * BLOCK}
    await queue(store, "r4", (*shared, 7000))
    assert await rounds.run(links) == 1
    (holder,) = [link for link in links if "r4" in link.requests]
    assert holder.requests["r4"].cached_tokens == 4 * BLOCK
    for link in links:  # first tokens came: their blocks are in the fleet's index from now on
        for rid, request in list(link.requests.items()):
            link.requests[rid] = replace(request, generated=1)
        assert link.placed_marks() == {}


async def test_prompts_placed_on_an_executor_that_does_not_cache_draw_nothing(store: Store) -> None:
    links = [open_link(store, "exec-1", caching=False), open_link(store, "exec-2", caching=False)]
    for i in range(2):
        await queue(store, f"r{i}", (*PROMPT[:96], 5000 + i))
    assert await admission(store).run(links) == 2
    assert [len(link.requests) for link in links] == [1, 1]  # the tie-break alone
    assert all(not r.prefix_marks for link in links for r in link.requests.values())


def dead_link(store: Store, executor_id: str) -> ExecutorLink:
    """A link whose executor does not answer: its stream ends as soon as it starts."""
    return ExecutorLink(executor_id, "127.0.0.1:1", store, CONFIG.scheduler, lambda _queue_moved: None)


async def test_a_link_that_ends_drops_its_executors_index(store: Store) -> None:
    dispatcher = Dispatcher(store, CONFIG, "replica-a")
    await store.prefixes.apply("exec-1", [CacheEvents(cleared=True, stored=(1, 2))])
    await dispatcher._drive(dead_link(store, "exec-1"))
    assert not await store.redis.exists(KEYS.cached_blocks("exec-1"))


async def test_a_link_that_ends_leaves_the_index_of_another_replicas_executor(store: Store) -> None:
    dispatcher = Dispatcher(store, CONFIG, "replica-a")
    assert await store.fleet.take_lease("exec-1", "replica-b", 10_000)  # replica-b drives it now
    await store.prefixes.apply("exec-1", [CacheEvents(cleared=True, stored=(1, 2))], "replica-b")
    await dispatcher._drive(dead_link(store, "exec-1"))
    assert await store.prefixes.size("exec-1") == 2


async def test_a_dead_executors_index_is_dropped(store: Store) -> None:
    dispatcher = Dispatcher(store, CONFIG, "replica-a")
    await store.redis.zadd(KEYS.executors, {"gone": 1, "alive": 2})  # heartbeats long ago
    await store.prefixes.apply("gone", [CacheEvents(cleared=True, stored=(1, 2))])
    await dispatcher._reap_dead(cutoff_ms=2)
    assert not await store.redis.exists(KEYS.cached_blocks("gone"))
    assert await store.redis.zscore(KEYS.executors, "gone") is None
