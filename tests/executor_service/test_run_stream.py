"""How the executor's Run handler ends: nothing of it outlives the call.

grpc.aio releases the core call when a handler finishes; a cancelled handler sends no status, so
its context still looks live, and ``context.peer()`` on it then crashes the process (a null call
in cygrpc). The handler is a plain coroutine that reads the peer once and stops its plan reader
before it returns; these tests end the stream in each way it can end (the client cancels, a newer
stream supersedes it, the client closes its side) and check that invariant.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
from collections.abc import AsyncIterator, Iterator
from typing import cast

import grpc
import pytest

from common.pb import executor_pb2 as pb
from common.pb import executor_pb2_grpc
from executor_service.engine_io import PlanUpdate, TokenOut
from executor_service.load_metrics import LoadSampler
from executor_service.report_hub import ReportHub
from executor_service.servicer import ExecutorServicer
from executor_service.worker import EngineWorker
from tests.executor_service.test_token_batching import step
from tests.stack import eventually


class _Worker:
    """Records the plans the servicer submits; the engine is not needed here."""

    def __init__(self) -> None:
        self.plans: list[PlanUpdate] = []
        self.error: BaseException | None = None  # the engine thread never fails here

    def submit(self, plan: PlanUpdate) -> None:
        self.plans.append(plan)


class _Executor:
    def __init__(self) -> None:
        self.worker = _Worker()
        self.servicer = ExecutorServicer()
        self.hub = ReportHub(asyncio.get_running_loop())
        self.server = grpc.aio.server()
        executor_pb2_grpc.add_ExecutorServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.servicer.bind(cast(EngineWorker, self.worker), self.hub, LoadSampler("cpu"), pb.InfoResponse())

    def readers(self) -> int:
        return len(self.servicer._readers)  # the invariant under test


class _Client:
    """One Run stream: plans put into ``outbox`` go out; None closes the client's side."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.outbox: asyncio.Queue[pb.Plan | None] = asyncio.Queue()
        self.call = executor_pb2_grpc.ExecutorStub(channel).Run(self._plans())

    async def _plans(self) -> AsyncIterator[pb.Plan]:
        while (plan := await self.outbox.get()) is not None:
            yield plan


@pytest.fixture
async def executor() -> AsyncIterator[_Executor]:
    running = _Executor()
    await running.server.start()
    yield running
    await running.server.stop(0)


@pytest.fixture
async def channel(executor: _Executor) -> AsyncIterator[grpc.aio.Channel]:
    chan = grpc.aio.insecure_channel(f"127.0.0.1:{executor.port}")
    yield chan
    await chan.close()


@pytest.fixture(autouse=True)
def _collect_after() -> Iterator[None]:
    # A handler frame that had outlived its call would touch it when collected: collect here,
    # while the server still runs, so such a bug crashes this test and not a later one.
    yield
    gc.collect()


def test_run_is_a_plain_coroutine() -> None:
    # An async-generator handler is left suspended at its ``yield`` when a cancel hits grpc's
    # write, and its ``finally`` then runs after the call is released.
    assert inspect.iscoroutinefunction(ExecutorServicer.Run)
    assert not inspect.isasyncgenfunction(ExecutorServicer.Run)


async def _attached(executor: _Executor, client: _Client, seq: int) -> None:
    client.outbox.put_nowait(pb.Plan(seq=seq))
    await eventually(lambda: any(p.seq == seq for p in executor.worker.plans), f"plan {seq} to reach the engine")


def _abort_is_last(executor: _Executor) -> None:
    plans = executor.worker.plans
    assert plans and plans[-1].abort_all, "the stream's requests are aborted once it ends"
    assert sum(p.abort_all for p in plans) == 1, "and no plan of the ended stream follows the abort"


async def test_client_cancel_ends_the_reader_with_the_handler(executor: _Executor, channel: grpc.aio.Channel) -> None:
    client = _Client(channel)
    await _attached(executor, client, 1)
    assert executor.readers() == 1
    client.call.cancel()
    await eventually(lambda: not executor.hub.attached, "the handler to end")
    await eventually(lambda: executor.readers() == 0, "the plan reader to unwind", timeout=1.0)
    _abort_is_last(executor)


async def test_a_cancel_while_reports_stream_ends_cleanly(executor: _Executor, channel: grpc.aio.Channel) -> None:
    client = _Client(channel)
    await _attached(executor, client, 1)
    big = step(1, TokenOut("a", (1,), "x" * 60_000, 0))
    for _ in range(200):  # the client reads none: the handler's writes back up against flow control
        executor.hub.publish_threadsafe(big)
    queued = asyncio.Event()
    asyncio.get_running_loop().call_soon(queued.set)  # after the 200 reports reached the stream's queue
    await queued.wait()
    reports = executor.hub._stream.queue  # type: ignore[union-attr]
    await eventually(lambda: reports.qsize() < 200, "the handler to be writing reports")
    client.call.cancel()
    await eventually(lambda: not executor.hub.attached, "the handler to end")
    await eventually(lambda: executor.readers() == 0, "the plan reader to unwind", timeout=1.0)
    _abort_is_last(executor)


async def test_a_newer_stream_supersedes_the_old_one_and_its_reader(
    executor: _Executor, channel: grpc.aio.Channel
) -> None:
    old = _Client(channel)
    await _attached(executor, old, 1)
    new = _Client(channel)
    await _attached(executor, new, 2)
    # The old client's side is still open: only the handler's own stop ends its reader.
    await eventually(lambda: executor.readers() == 1, "the old stream's reader to stop")
    assert await old.call.code() == grpc.StatusCode.OK
    assert executor.hub.attached
    # What the old stream admitted stops before the new stream's first plan, and nothing after it.
    assert [(p.seq, p.abort_all) for p in executor.worker.plans] == [(1, False), (0, True), (2, False)]
    new.call.cancel()
    await eventually(lambda: not executor.hub.attached, "the new handler to end")
    await eventually(lambda: executor.readers() == 0, "the plan reader to unwind", timeout=1.0)


async def test_client_closing_its_side_ends_the_stream(executor: _Executor, channel: grpc.aio.Channel) -> None:
    client = _Client(channel)
    await _attached(executor, client, 1)
    client.outbox.put_nowait(None)
    assert await client.call.code() == grpc.StatusCode.OK
    await eventually(lambda: not executor.hub.attached, "the handler to end")
    await eventually(lambda: executor.readers() == 0, "the plan reader to unwind", timeout=1.0)
    _abort_is_last(executor)
