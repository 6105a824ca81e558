"""What an executor link keeps and exchanges: its view of each request, the gRPC channel
options, the sampling conversion and prefill grants for plans, and the task that moves step
reports into an inbox."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass

from common.pb import executor_pb2 as pb
from scheduler_service.requests import RequestParams

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


def sampling_to_pb(params: RequestParams) -> pb.ExecSampling:
    msg = pb.ExecSampling(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


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
