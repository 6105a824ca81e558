"""Drives Baton's public gRPC API with a workload and records what each request saw, chunk by chunk."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from baton.bench.multi_turn import Conversation, turn_prompt
from baton.bench.stats import RequestTiming
from baton.bench.workload import RequestSpec
from common.pb import generate_pb2 as pb
from common.pb.generate_pb2_grpc import GenerationStub

WARM_PROMPT, WARM_TOKENS = (1, 5, 6, 7, 8, 9, 10, 11), 4
# A few channels spread a thousand streams over several HTTP/2 connections.
STREAMS_PER_CHANNEL = 256


@dataclass(frozen=True)
class RunPlan:
    """How to send a workload."""

    max_concurrency: int  # most requests in flight; the rest wait client-side
    offsets: Sequence[float] | None = None  # send times from the start (s); None sends as fast as allowed
    timeout_s: float = 600.0  # gRPC deadline of each request
    metadata: tuple[tuple[str, str], ...] = ()
    credentials: grpc.ChannelCredentials | None = None  # TLS to the scheduler; None dials plaintext

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {self.max_concurrency}")


def request_pb(spec: RequestSpec) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=0.0)
    return pb.GenerateRequest(prompt_token_ids=spec.prompt_ids, params=params)


async def stream_one(
    stub: GenerationStub, spec: RequestSpec, plan: RunPlan, timing: RequestTiming, tokens: list[int] | None = None
) -> None:
    """Send one request and time every token-carrying chunk; errors are recorded, not raised.
    ``tokens``: when given, the generated ids are appended to it."""
    timing.sent = time.perf_counter()
    try:
        call = stub.Generate(request_pb(spec), timeout=plan.timeout_s, metadata=plan.metadata or None)
        async for chunk in call:
            if chunk.token_ids:
                timing.chunk_times.append(time.perf_counter())
                timing.output_len += len(chunk.token_ids)
                if tokens is not None:
                    tokens.extend(chunk.token_ids)
            if chunk.finish_reason not in (pb.FINISH_REASON_NONE, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP):
                timing.error = pb.FinishReason.Name(chunk.finish_reason)
            if chunk.HasField("usage"):
                timing.cached_len = chunk.usage.cached_tokens
    except grpc.aio.AioRpcError as exc:
        timing.error = f"{exc.code().name}: {exc.details()}"
    if not timing.chunk_times and not timing.error:
        timing.error = "no tokens"


async def wait_until_serving(
    stub: GenerationStub, timeout_s: float = 120.0, metadata: tuple[tuple[str, str], ...] = ()
) -> None:
    """Send a short warm-up request until one succeeds: UNAVAILABLE until an executor has attached."""
    deadline = time.monotonic() + timeout_s
    warm = RequestSpec(WARM_PROMPT, WARM_TOKENS)
    while True:
        try:
            async for _ in stub.Generate(request_pb(warm), timeout=timeout_s, metadata=metadata or None):
                pass
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def open_stubs(
    target: str, in_flight: int, credentials: grpc.ChannelCredentials | None = None
) -> AsyncIterator[list[GenerationStub]]:
    """Stubs over enough channels for ``in_flight`` concurrent streams, closed on exit; TLS with
    ``credentials``."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.secure_channel(target, credentials, options=options)
        if credentials is not None
        else grpc.aio.insecure_channel(target, options=options)
        for _ in range(max(1, in_flight) // STREAMS_PER_CHANNEL + 1)
    ]
    try:
        yield [GenerationStub(channel) for channel in channels]
    finally:
        for channel in channels:
            await channel.close()


def _finished(timings: Sequence[RequestTiming]) -> float:
    return max((t.chunk_times[-1] for t in timings if t.chunk_times), default=time.perf_counter())


async def run_workload(
    target: str,
    specs: Sequence[RequestSpec],
    plan: RunPlan,
    on_done: Callable[[RequestTiming], None] | None = None,
    warm_up: bool = True,
) -> tuple[list[RequestTiming], float]:
    """Send ``specs`` per ``plan``; return their timings and the seconds from the first send to the last finish."""
    async with open_stubs(target, min(plan.max_concurrency, len(specs)), plan.credentials) as stubs:
        if warm_up:
            await wait_until_serving(stubs[0], metadata=plan.metadata)
        timings = [RequestTiming(len(s.prompt_ids), s.output_len) for s in specs]
        slots = asyncio.Semaphore(plan.max_concurrency)
        started = time.perf_counter()

        async def one(i: int) -> None:
            if plan.offsets is not None:
                await asyncio.sleep(max(0.0, started + plan.offsets[i] - time.perf_counter()))
            async with slots:
                await stream_one(stubs[i % len(stubs)], specs[i], plan, timings[i])
            if on_done is not None:
                on_done(timings[i])

        await asyncio.gather(*(one(i) for i in range(len(specs))))
        return timings, _finished(timings) - started


async def run_conversations(
    target: str,
    conversations: Sequence[Conversation],
    plan: RunPlan,
    on_done: Callable[[RequestTiming], None] | None = None,
    warm_up: bool = True,
) -> tuple[list[list[RequestTiming]], float]:
    """Hold each conversation turn by turn, each prompt the history so far (``turn_prompt``) with the
    model's real answers; at most ``plan.max_concurrency`` conversations at once (``plan.offsets``
    unused). Returns the timings by conversation and turn, and the seconds from the first send to
    the last finish. A failed turn ends its conversation: its later turns are recorded as failed."""
    async with open_stubs(target, min(plan.max_concurrency, len(conversations)), plan.credentials) as stubs:
        if warm_up:
            await wait_until_serving(stubs[0], metadata=plan.metadata)
        timings: list[list[RequestTiming]] = [[] for _ in conversations]
        slots = asyncio.Semaphore(plan.max_concurrency)
        started = time.perf_counter()

        async def talk(i: int) -> None:
            conv, outputs = conversations[i], list[list[int]]()
            async with slots:
                for turn, output_len in enumerate(conv.output_lens):
                    if len(outputs) < turn:  # an earlier turn failed: no history to send
                        timing = RequestTiming(0, output_len, error="an earlier turn failed")
                    else:
                        spec = RequestSpec(turn_prompt(conv.messages, outputs), output_len, group=i)
                        timing, answer = RequestTiming(len(spec.prompt_ids), output_len), list[int]()
                        await stream_one(stubs[i % len(stubs)], spec, plan, timing, answer)
                        if timing.ok:
                            outputs.append(answer)
                    timings[i].append(timing)
                    if on_done is not None:
                        on_done(timing)

        await asyncio.gather(*(talk(i) for i in range(len(conversations))))
        return timings, _finished([t for conv in timings for t in conv]) - started
