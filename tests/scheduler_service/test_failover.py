"""Kill things for real (SIGKILL), restart Redis: no request is lost, no token repeated or skipped.

Each test runs Baton as separate processes and checks every client's tokens against the greedy
``model.generate`` output of its prompt alone.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.process_stack import ProcessStack
from tests.scheduler_service.test_end_to_end import greedy, random_prompts

MAX_TOKENS = 40
_SERVER_GONE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
)


@pytest.fixture
def processes(tmp_path: Path, tiny_model_dir: Path) -> Iterator[ProcessStack]:
    stack = ProcessStack(tmp_path, tiny_model_dir)
    stack.start_redis()
    yield stack
    stack.stop_all()


class Clients:
    """Streams many requests at once and keeps what each received, with arrival times."""

    def __init__(self, prompts: list[list[int]], prefix: str) -> None:
        self.prompts = prompts
        self.ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        self.tokens: dict[str, list[int]] = {rid: [] for rid in self.ids}
        self.arrivals: dict[str, list[float]] = {rid: [] for rid in self.ids}
        self.finish: dict[str, int] = {}

    def take(self, request_id: str, chunk: pb.GenerateResponse) -> None:
        assert chunk.index == len(self.tokens[request_id]), "a gap or a repeat in the stream"
        self.tokens[request_id].extend(chunk.token_ids)
        self.arrivals[request_id].append(time.monotonic())
        if chunk.finish_reason:
            self.finish[request_id] = chunk.finish_reason

    async def stream(self, stub: generate_pb2_grpc.GenerationStub, i: int) -> None:
        async for chunk in stub.Generate(greedy(self.prompts[i], MAX_TOKENS, request_id=self.ids[i])):
            self.take(self.ids[i], chunk)

    async def resume(self, stub: generate_pb2_grpc.GenerationStub, request_id: str) -> None:
        request = pb.ResumeRequest(request_id=request_id, from_index=len(self.tokens[request_id]))
        async for chunk in stub.Resume(request):
            self.take(request_id, chunk)

    async def wait_all_started(self, minimum: int = 3, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while min(len(t) for t in self.tokens.values()) < minimum:
            assert time.monotonic() < deadline, "requests did not start"
            await asyncio.sleep(0.02)

    def longest_pause_after(self, moment: float) -> float:
        """The longest wait between two tokens of one request once ``moment`` has passed: the time to recover."""
        pauses = [0.0]
        for times in self.arrivals.values():
            for before, after in itertools.pairwise(times):
                if after >= moment:
                    pauses.append(after - before)
        return max(pauses)

    def check_exact(self, model_dir: Path) -> None:
        reference_model = load_reference_model(model_dir)
        for i, rid in enumerate(self.ids):
            assert self.finish.get(rid) == pb.FINISH_REASON_LENGTH, rid
            assert_matches_reference(
                self.tokens[rid], reference_greedy(reference_model, self.prompts[i], MAX_TOKENS), rid
            )


async def test_executor_sigkill_mid_stream_loses_and_repeats_nothing(
    processes: ProcessStack, tiny_model_dir: Path
) -> None:
    processes.start_executor("exec-a")
    processes.start_executor("exec-b")
    target = processes.start_scheduler("sched-1")
    clients = Clients(random_prompts(20, seed=21), "xk")
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        tasks = [asyncio.create_task(clients.stream(stub, i)) for i in range(20)]
        await clients.wait_all_started()
        client = redis.Redis.from_url(processes.redis_url, decode_responses=True)
        victim = max(("exec-a", "exec-b"), key=lambda e: client.scard(f"{{baton}}:executor:{e}:running"))
        assert client.scard(f"{{baton}}:executor:{victim}:running") > 0
        processes.kill(victim)
        killed_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
        migrated = [rid for rid in clients.ids if client.hget(f"{{baton}}:req:{rid}", "migrations")]
    assert migrated, "the killed executor ran no request"
    clients.check_exact(tiny_model_dir)
    print(
        f"\nexecutor kill: {len(migrated)} requests migrated, recovery {clients.longest_pause_after(killed_at):.2f} s"
    )


async def test_scheduler_sigkill_then_resume_on_another_replica(processes: ProcessStack, tiny_model_dir: Path) -> None:
    processes.start_executor("exec-a")
    first = processes.start_scheduler("sched-1")
    second = processes.start_scheduler("sched-2")
    clients = Clients(random_prompts(10, seed=22), "sk")
    async with grpc.aio.insecure_channel(first) as channel_1, grpc.aio.insecure_channel(second) as channel_2:
        stub_1, stub_2 = generate_pb2_grpc.GenerationStub(channel_1), generate_pb2_grpc.GenerationStub(channel_2)

        async def stream_then_resume(i: int) -> None:
            try:
                await clients.stream(stub_1, i)
            except grpc.aio.AioRpcError as exc:
                # A server killed mid-stream shows up as whatever its dropped connection looked
                # like: UNAVAILABLE or CANCELLED mostly, INTERNAL or UNKNOWN when a frame was cut.
                assert exc.code() in _SERVER_GONE, f"{exc.code()}: {exc.details()}"
                await clients.resume(stub_2, clients.ids[i])

        tasks = [asyncio.create_task(stream_then_resume(i)) for i in range(10)]
        await clients.wait_all_started()
        processes.kill("sched-1")
        killed_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
    clients.check_exact(tiny_model_dir)
    print(f"\nscheduler kill: recovery {clients.longest_pause_after(killed_at):.2f} s")


async def test_redis_restart_mid_run_finishes_everything(processes: ProcessStack, tiny_model_dir: Path) -> None:
    processes.start_executor("exec-a")
    target = processes.start_scheduler("sched-1")
    clients = Clients(random_prompts(10, seed=23), "rr")
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        tasks = [asyncio.create_task(clients.stream(stub, i)) for i in range(10)]
        await clients.wait_all_started()
        processes.stop("redis")
        stopped_at = time.monotonic()
        await asyncio.sleep(1.5)
        processes.start_redis()
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
    for name in ("exec-a", "sched-1"):
        assert processes.procs[name].poll() is None, f"{name} died: {processes.log(name)[-2000:]}"
    clients.check_exact(tiny_model_dir)
    print(f"\nredis restart: recovery {clients.longest_pause_after(stopped_at):.2f} s")
