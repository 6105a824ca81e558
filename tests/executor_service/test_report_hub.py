"""The hub between the engine thread and the attached Run stream: steps observed and held on the
engine thread, only reports crossing to the event loop."""

from __future__ import annotations

import asyncio
import threading

from executor_service.engine_io import KvCacheEvents, StepOutput
from executor_service.report_hub import ReportHub
from executor_service.token_batching import StreamInterval, TokenBatcher
from tests.executor_service.test_token_batching import step, tok


def from_engine_thread(hub: ReportHub, outputs: list[StepOutput]) -> None:
    def publish_all() -> None:
        for out in outputs:
            hub.publish_threadsafe(out)

    thread = threading.Thread(target=publish_all)
    thread.start()
    thread.join()


async def drained(queue: asyncio.Queue[StepOutput | None]) -> list[StepOutput | None]:
    await asyncio.sleep(0.05)  # let the loop run the callbacks the engine thread scheduled
    return [queue.get_nowait() for _ in range(queue.qsize())]


async def test_held_steps_stay_on_the_engine_thread_and_every_step_is_observed() -> None:
    observed: list[int] = []
    hub = ReportHub(asyncio.get_running_loop(), lambda out: observed.append(out.iteration))
    held = TokenBatcher(1, 1000.0)
    held.admitted("a", StreamInterval(3))
    queue = hub.attach(held)
    from_engine_thread(hub, [step(i + 1, tok("a", i)) for i in range(4)])
    reports = await drained(queue)
    assert observed == [1, 2, 3, 4]
    assert [r.iteration for r in reports if r is not None] == [1, 4]  # the first token, then 3 merged
    assert reports[1] is not None and reports[1].tokens[0].token_ids == (101, 102, 103)
    assert hub.latest is not None and hub.latest.iteration == 4


async def test_without_a_coalescer_every_step_is_a_report_and_without_a_stream_none_is() -> None:
    observed: list[int] = []
    hub = ReportHub(asyncio.get_running_loop(), lambda out: observed.append(out.iteration))
    queue = hub.attach()
    from_engine_thread(hub, [step(1, tok("a", 0)), step(2, tok("a", 1))])
    assert [r.iteration for r in await drained(queue) if r is not None] == [1, 2]
    assert hub.detach(queue)
    from_engine_thread(hub, [step(3, tok("a", 2))])
    assert await drained(queue) == [] and observed == [1, 2, 3]


async def test_a_new_stream_supersedes_the_old_one() -> None:
    hub = ReportHub(asyncio.get_running_loop())
    old = hub.attach()
    new = hub.attach(TokenBatcher(1, 0.0))
    assert old.get_nowait() is None  # the old stream is told to end
    # Its plan reader stops at its next plan: one read later would apply behind the new stream's.
    assert hub.is_current(new) and not hub.is_current(old)
    assert not hub.detach(old)  # the new one is still attached
    from_engine_thread(hub, [step(1, tok("a", 0))])
    assert [r.iteration for r in await drained(new) if r is not None] == [1]


async def test_a_superseded_streams_report_never_reaches_the_new_stream() -> None:
    hub = ReportHub(asyncio.get_running_loop())
    old = hub.attach()
    from_engine_thread(hub, [step(1, tok("a", 0))])  # handed to the loop for the old stream
    new = hub.attach()  # before the loop ran that hand-over
    assert await drained(new) == []
    assert await drained(old) == [None]  # the old stream is only told to end


async def test_each_new_streams_first_report_restates_the_whole_prefix_cache() -> None:
    names: list[tuple[int, ...]] = [(1, 2)]
    hub = ReportHub(asyncio.get_running_loop(), cached_names=lambda: names[0])
    first = hub.attach(TokenBatcher(1, 0.0))
    from_engine_thread(hub, [step(1, tok("a", 0), kv_events=KvCacheEvents(stored=(2,)))])
    from_engine_thread(hub, [step(2, tok("a", 1), kv_events=KvCacheEvents(stored=(3,)))])
    reports = [r for r in await drained(first) if r is not None]
    assert [r.kv_events for r in reports] == [KvCacheEvents(cleared=True, stored=(1, 2)), KvCacheEvents(stored=(3,))]
    names[0] = (1, 2, 3)
    held = TokenBatcher(3, 1000.0)
    held.admitted("a", StreamInterval(3))
    second = hub.attach(held)
    removal = KvCacheEvents(removed=(1,))
    from_engine_thread(
        hub, [step(3 + i, tok("a", 2 + i), kv_events=removal if i == 1 else KvCacheEvents()) for i in range(4)]
    )
    reports = [r for r in await drained(second) if r is not None]
    assert [r.iteration for r in reports] == [3, 6]  # the first tokens, then three steps held and merged
    assert [r.kv_events for r in reports] == [KvCacheEvents(cleared=True, stored=(1, 2, 3)), removal]


async def test_without_prefix_caching_a_new_stream_gets_no_clear() -> None:
    hub = ReportHub(asyncio.get_running_loop())
    queue = hub.attach()
    from_engine_thread(hub, [step(1, tok("a", 0))])
    assert [r.kv_events for r in await drained(queue) if r is not None] == [KvCacheEvents()]
