"""Kill things for real (SIGKILL), restart Redis: no request is lost, no token repeated or skipped.

Each test runs Baton as separate processes and checks every client's tokens against the greedy
``model.generate`` output of its prompt alone. Each also checks that what it kills was doing the
work when it died (it drove the executor, the requests were mid-stream), so none passes by
killing something idle.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
from pathlib import Path

import grpc
import pytest
import redis

from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from tests.executor_service.reference import (
    Reference,
    assert_matches_reference,
    load_reference_model,
    reference_greedy,
)
from tests.process_stack import ProcessStack
from tests.scheduler_service.test_end_to_end import greedy, random_prompts
from tests.stack import eventually

MAX_TOKENS = 40
LEASE = "{baton}:lease:executor:%s"
TOKENS = "{baton}:req:%s:tokens"
REQUEST = "{baton}:req:%s"
_SERVER_GONE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
)


class Clients:
    """Streams many requests at once and keeps what each received, with arrival times."""

    def __init__(self, prompts: list[list[int]], prefix: str, max_tokens: int = MAX_TOKENS) -> None:
        self.prompts = prompts
        self.max_tokens = max_tokens
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
        async for chunk in stub.Generate(greedy(self.prompts[i], self.max_tokens, request_id=self.ids[i])):
            self.take(self.ids[i], chunk)

    async def resume(self, stub: generate_pb2_grpc.GenerationStub, request_id: str) -> None:
        request = pb.ResumeRequest(request_id=request_id, from_index=len(self.tokens[request_id]))
        async for chunk in stub.Resume(request):
            self.take(request_id, chunk)

    async def stream_then_resume(
        self, first: generate_pb2_grpc.GenerationStub, second: generate_pb2_grpc.GenerationStub, i: int
    ) -> bool:
        """Stream request ``i`` from ``first``; where its server goes away, resume on ``second``.
        Whether it had to."""
        try:
            await self.stream(first, i)
        except grpc.aio.AioRpcError as exc:
            # A server gone mid-stream shows up as whatever its dropped connection looked like:
            # UNAVAILABLE or CANCELLED mostly, INTERNAL or UNKNOWN when a frame was cut.
            assert exc.code() in _SERVER_GONE, f"{exc.code()}: {exc.details()}"
            await self.resume(second, self.ids[i])
            return True
        return False

    async def wait_all_started(self, minimum: int = 3, timeout: float = 120) -> None:
        await eventually(lambda: min(len(t) for t in self.tokens.values()) >= minimum, "requests to start", timeout)

    def seen(self) -> dict[str, int]:
        """How many tokens each client holds now."""
        return {rid: len(tokens) for rid, tokens in self.tokens.items()}

    def longest_pause_after(self, moment: float) -> float:
        """The longest wait between two tokens of one request once ``moment`` has passed: the time to recover."""
        pauses = [0.0]
        for times in self.arrivals.values():
            for before, after in itertools.pairwise(times):
                if after >= moment:
                    pauses.append(after - before)
        return max(pauses)

    def check_exact(self, model_dir: Path) -> None:
        for i, rid in enumerate(self.ids):
            assert self.finish.get(rid) == pb.FINISH_REASON_LENGTH, rid
            assert_matches_reference(
                self.tokens[rid], _reference(model_dir, tuple(self.prompts[i]), self.max_tokens), rid
            )


@functools.cache
def _reference(model_dir: Path, prompt: tuple[int, ...], max_tokens: int) -> Reference:
    """``model.generate``'s greedy output, computed once per prompt for every test here that sends it
    (both Redis-kill cases send the same prompts; 512 tokens of the reference take seconds each)."""
    return reference_greedy(_reference_model(model_dir), list(prompt), max_tokens)


_reference_model = functools.cache(load_reference_model)


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
    """The replica driving the executor dies; the other takes its lease and finishes its requests."""
    processes.start_executor("exec-a")
    first = processes.start_scheduler("sched-1")
    victim = processes.replica_id("sched-1")
    client = redis.Redis.from_url(processes.redis_url, decode_responses=True)
    lease = LEASE % "exec-a"
    # The second replica starts only once the first holds the executor, so the kill hits the
    # replica doing the work, not an idle one whose death would test nothing.
    await eventually(lambda: client.get(lease) == victim, "the first replica to lease the executor", 20.0)
    second = processes.start_scheduler("sched-2")
    survivor = processes.replica_id("sched-2")
    assert survivor != victim
    clients = Clients(random_prompts(10, seed=22), "sk", max_tokens=64)
    async with grpc.aio.insecure_channel(first) as channel_1, grpc.aio.insecure_channel(second) as channel_2:
        stub_1, stub_2 = generate_pb2_grpc.GenerationStub(channel_1), generate_pb2_grpc.GenerationStub(channel_2)
        tasks = [asyncio.create_task(clients.stream_then_resume(stub_1, stub_2, i)) for i in range(10)]
        await clients.wait_all_started()
        assert client.get(lease) == victim, "the executor changed hands before the kill"
        processes.kill("sched-1")
        killed_at = time.monotonic()
        # The victim is dead, and the survivor cannot write before the lease expires: this is what
        # the victim left recorded. Tokens past it were recorded by the survivor.
        recorded = {rid: int(client.llen(TOKENS % rid)) for rid in clients.ids}
        mid_stream = [rid for rid in clients.ids if recorded[rid] < clients.max_tokens]
        assert len(mid_stream) >= len(clients.ids) // 2, f"too few requests were mid-stream at the kill: {recorded}"
        await eventually(lambda: client.get(lease) == survivor, "the survivor to lease the executor", 20.0)
        had_to = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        resumed = {rid for rid, resuming in zip(clients.ids, had_to, strict=True) if resuming}
        # A request submitted after the takeover is served by the survivor's link to the executor.
        late = Clients(random_prompts(1, seed=122), "sk-late", max_tokens=16)
        await asyncio.wait_for(late.stream(stub_2, 0), 60)
    assert client.get(lease) == survivor
    assert set(mid_stream) <= resumed, "a mid-stream client was not cut off by the kill"
    for rid in mid_stream:
        # Re-admitted by the survivor (a migration), and finished by it.
        assert int(client.hget(f"{{baton}}:req:{rid}", "migrations") or 0) >= 1, rid
        assert int(client.llen(TOKENS % rid)) == clients.max_tokens > recorded[rid], rid
    clients.check_exact(tiny_model_dir)
    late.check_exact(tiny_model_dir)
    print(
        f"\nscheduler kill: {len(mid_stream)} requests taken over mid-stream, "
        f"recovery {clients.longest_pause_after(killed_at):.2f} s"
    )


async def test_scheduler_sigterm_leaves_its_streams_to_resume_on_another_replica(
    processes: ProcessStack, tiny_model_dir: Path
) -> None:
    """A rolling update stops a replica with streams open: they are cut, not taken for clients that
    left, so every request runs on and its client follows it on the other replica; a planned stop
    spends no migration."""
    processes.start_executor("exec-a")
    first = processes.start_scheduler("sched-1")
    victim = processes.replica_id("sched-1")
    client = redis.Redis.from_url(processes.redis_url, decode_responses=True)
    await eventually(lambda: client.get(LEASE % "exec-a") == victim, "the first replica to lease the executor", 20.0)
    second = processes.start_scheduler("sched-2")
    clients = Clients(random_prompts(4, seed=23), "st", max_tokens=800)  # outlasting the 2 s grace
    async with grpc.aio.insecure_channel(first) as channel_1, grpc.aio.insecure_channel(second) as channel_2:
        stub_1, stub_2 = generate_pb2_grpc.GenerationStub(channel_1), generate_pb2_grpc.GenerationStub(channel_2)
        tasks = [asyncio.create_task(clients.stream_then_resume(stub_1, stub_2, i)) for i in range(len(clients.ids))]
        await clients.wait_all_started()
        assert await asyncio.to_thread(processes.stop, "sched-1") == 0
        resumed = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert any(resumed), "no stream was open when the replica stopped"
    for rid in clients.ids:
        assert client.hget(REQUEST % rid, "state") == "FINISHED", rid
        assert not client.hget(REQUEST % rid, "migrations"), rid
    clients.check_exact(tiny_model_dir)


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


@pytest.mark.parametrize("lost_s", [0.0, 0.5], ids=["aof-replayed", "aof-tail-lost"])
async def test_redis_sigkill_mid_run_keeps_every_stream_exact(
    processes: ProcessStack, tiny_model_dir: Path, lost_s: float
) -> None:
    """SIGKILL Redis mid-run and restart it on its data directory: the AOF replays.

    A killed Redis keeps what it wrote to its AOF (the kernel holds it), so ``aof-replayed`` loses
    nothing acknowledged. With ``appendfsync everysec`` a crashed host loses up to about a second
    of writes, acknowledged ones included: ``aof-tail-lost`` cuts the AOF back to where it stood
    ``lost_s`` before the kill, so records restart behind what clients already saw. Short requests
    that end inside that window lose their ends too: their records say RUNNING again, on an
    executor done with them, and must still reach their ends.
    """
    processes.start_executor("exec-a")
    target = processes.start_scheduler("sched-1")
    # Long enough that every stream outlives the lost window and the kill with room to spare: on a
    # 2-vCPU Zen machine 128 tokens ran to their ends within the window (about 200 tokens a second
    # each); 512 last about 2 s there.
    clients = Clients(random_prompts(10, seed=24), "rk", max_tokens=512)
    # Long enough to be still running when the cut is taken, on a fast machine too (6 tokens ended
    # before it there), short enough to end well before the long ones.
    short = Clients(random_prompts(3, seed=25), "rs", max_tokens=48)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        tasks = [asyncio.create_task(clients.stream(stub, i)) for i in range(10)]
        short_tasks = [asyncio.create_task(short.stream(stub, i)) for i in range(3)]
        await short.wait_all_started(minimum=1)  # their records exist: the cut keeps them, not their ends
        aof, cut = processes.aof_tail()
        assert not short.finish, "a short request ended before the cut"
        await clients.wait_all_started(minimum=1)
        await asyncio.sleep(lost_s)
        await asyncio.wait_for(asyncio.gather(*short_tasks), 60)  # ended, and their clients saw it
        processes.kill("redis")
        killed_at = time.monotonic()
        seen = clients.seen()
        mid_stream = [rid for rid, n in seen.items() if n < clients.max_tokens]
        assert len(mid_stream) >= len(clients.ids) // 2, f"too few requests were mid-stream at the kill: {seen}"
        if lost_s:
            os.truncate(aof, cut)
            with processes.replayed() as disk:
                behind = {rid: int(disk.llen(TOKENS % rid)) for rid in clients.ids}
                unended = [rid for rid in short.ids if disk.hget(REQUEST % rid, "state") != "FINISHED"]
            regressed = [rid for rid in clients.ids if behind[rid] < seen[rid]]
            assert regressed, f"the cut lost no token a client had seen: {behind} vs {seen}"
            assert unended == short.ids, "the cut kept a short request's end"
        processes.start_redis()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        everyone = clients.ids + short.ids
        states: list[pb.GetRequestResponse] = []

        async def all_finished() -> bool:
            states[:] = [await stub.GetRequest(pb.GetRequestRequest(request_id=rid)) for rid in everyone]
            return all(state.state == pb.REQUEST_STATE_FINISHED for state in states)

        await eventually(all_finished, "every record to reach its end", 60.0)
    for name in ("exec-a", "sched-1"):
        assert processes.procs[name].poll() is None, f"{name} died: {processes.log(name)[-2000:]}"
    for rid in mid_stream:
        assert len(clients.tokens[rid]) == clients.max_tokens > seen[rid], rid
    clients.check_exact(tiny_model_dir)
    short.check_exact(tiny_model_dir)
    lengths = {rid: clients.max_tokens for rid in clients.ids} | {rid: short.max_tokens for rid in short.ids}
    for state in states:
        assert state.tokens_generated == lengths[state.request_id], f"{state.request_id}: {state}"
    print(
        f"\nredis sigkill ({lost_s:.1f} s lost): {len(mid_stream)} mid-stream"
        + (f", {len(regressed)} records behind their clients, {len(unended)} ends lost" if lost_s else "")
        + f", recovery {clients.longest_pause_after(killed_at):.2f} s"
    )
