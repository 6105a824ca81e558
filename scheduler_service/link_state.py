"""What an executor link keeps and exchanges: its view of each request (and the room and
preemption choices that view implies), the gRPC channel options, the admission and sampling
conversions and prefill grants for plans, and the task that moves step reports into an inbox."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterable, Collection, Iterable
from dataclasses import dataclass

from common.pb import executor_pb2 as pb
from scheduler_service.placement import ExecutorCapacity, blocks_for
from scheduler_service.preemption import RunningRequest
from scheduler_service.requests import ClaimedRequest

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


@dataclass
class LinkedRequest:
    """The replica's view of one request on this executor."""

    request_id: str
    prompt_len: int
    generated: int
    arrival_ms: int
    assigned_ms: int
    first_token_ms: int | None
    priority: int = 0
    preemptions: int = 0
    deadline_ms: int = 0
    expected_output: int = 0  # the estimator's guess at enqueue (else max_tokens)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def remaining(self) -> int:
        """Output tokens still expected: what length-aware merging compares."""
        return max(1, self.expected_output - self.generated)

    @property
    def outstanding_tokens(self) -> int:
        """Tokens its executor still expects to process for it: the output still expected, and the
        prompt while no token has come (its prefill may be under way)."""
        return self.remaining + (self.prompt_len if self.generated == 0 else 0)


def capacity_of(
    executor_id: str, requests: Collection[LinkedRequest], info: pb.InfoResponse, max_batch: int, fraction: float
) -> ExecutorCapacity:
    """An executor's room for new requests, given the requests on it; ``fraction`` < 1 shrinks it
    under load (rounding up, so never to 0)."""
    committed = sum(blocks_for(r.num_tokens + 1, info.block_size) for r in requests)
    total = info.kv_blocks_total
    watermark = max(1, total // 100)  # headroom so decodes rarely force a preemption
    return ExecutorCapacity(
        executor_id=executor_id,
        free_slots=math.ceil(max(0, max_batch - len(requests)) * fraction),
        free_blocks=math.ceil(max(0, total - committed - watermark) * fraction),
        total_blocks=total,
        block_size=info.block_size,
        outstanding_tokens=sum(r.outstanding_tokens for r in requests),
    )


def preemptible(
    requests: Iterable[LinkedRequest], preempting: Collection[str], block_size: int
) -> list[RunningRequest]:
    """What preemption may choose from: the requests not already being preempted."""
    return [
        RunningRequest(r.request_id, r.priority, r.preemptions, blocks_for(r.num_tokens + 1, block_size), r.generated)
        for r in requests
        if r.request_id not in preempting
    ]


def prefill_grants(admits: Iterable[pb.AdmitRequest], budget: int, max_chunk: int) -> list[pb.PrefillGrant]:
    """Prefill tokens for the newly admitted, in plan order, from what the step budget leaves."""
    grants: list[pb.PrefillGrant] = []
    for admit in admits:
        if budget <= 0:
            break
        grant = min(budget, len(admit.prompt_token_ids) + len(admit.output_token_ids), max_chunk)
        grants.append(pb.PrefillGrant(request_id=admit.request_id, num_tokens=grant))
        budget -= grant
    return grants


def linked_request_of(claimed: ClaimedRequest) -> LinkedRequest:
    return LinkedRequest(
        request_id=claimed.request_id,
        prompt_len=len(claimed.prompt_ids),
        generated=len(claimed.output_ids),
        arrival_ms=claimed.arrival_ms,
        assigned_ms=claimed.assigned_ms,
        first_token_ms=claimed.first_token_ms,
        priority=claimed.priority,
        preemptions=claimed.preemptions,
        deadline_ms=claimed.deadline_ms,
        expected_output=claimed.expected_output or claimed.params.max_tokens,
    )


def admit_pb(claimed: ClaimedRequest, stream_interval_tokens: int, stream_interval_ms: int) -> pb.AdmitRequest:
    """The plan's admission of ``claimed``, whose client takes its tokens at that stream interval."""
    return pb.AdmitRequest(
        request_id=claimed.request_id,
        prompt_token_ids=claimed.prompt_ids,
        output_token_ids=claimed.output_ids,
        sampling=claimed.params.to_pb(),
        rank=claimed.score,
        traceparent=claimed.traceparent,
        stream_interval_tokens=stream_interval_tokens,
        stream_interval_ms=stream_interval_ms,
    )


async def read_reports(
    call: AsyncIterable[pb.StepReport], inbox: asyncio.Queue[pb.StepReport | BaseException | None]
) -> None:
    """Move the stream's reports into ``inbox``; then None at its end, or the error that ended it."""
    try:
        async for report in call:
            inbox.put_nowait(report)
        inbox.put_nowait(None)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        inbox.put_nowait(exc)
