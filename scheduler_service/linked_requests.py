"""An executor link's view of the requests on its executor, and what that view implies: the
executor's room for more (placement) and the requests preemption may choose from."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from common.pb import executor_pb2 as pb
from scheduler_service.placement import IDLE, ExecutorCapacity, request_kv_blocks
from scheduler_service.preemption import RunningRequest
from scheduler_service.requests import ClaimedRequest


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
    cached_tokens: int = 0  # the prefix its executor was expected to find cached at admission
    # The prompt tokens it found cached when it first produced a token, as its executor reported
    # (kept in its record across preemptions and migrations); None until then.
    cached_prompt_tokens: int | None = None
    # Its prompt's marks where they name this executor's blocks (placement.PrefixMarks): placement
    # counts them as placed here until its first token, whose report names its prompt's blocks.
    prefix_marks: tuple[str, ...] = ()
    # The output tokens it had when admitted here: a resumed (preempted or migrated) request
    # prefills them again with its prompt before it makes a new token.
    resumed_with: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def prefilling(self) -> bool:
        """No token has come from this executor yet: its prefill may be under way."""
        return self.generated == self.resumed_with

    @property
    def remaining(self) -> int:
        """Output tokens still expected: what length-aware merging compares."""
        return max(1, self.expected_output - self.generated)

    @property
    def outstanding_tokens(self) -> int:
        """Tokens its executor still expects to process for it: the output still expected, and what
        it prefills (its prompt, and a resumed request's output so far) while no token has come, less
        the prefix expected in its prefix cache (at least one token is always computed)."""
        prefill = max(1, self.prompt_len + self.resumed_with - self.cached_tokens) if self.prefilling else 0
        return self.remaining + prefill


def capacity_of(
    executor_id: str,
    requests: Collection[LinkedRequest],
    info: pb.InfoResponse,
    max_batch: int,
    fraction: float,
    chunk_tokens: int = 0,
) -> ExecutorCapacity:
    """An executor's room for new requests, given the requests on it; ``fraction`` < 1 shrinks it
    under load (rounding up, so never to 0). ``chunk_tokens``: the most tokens of one request it
    computes in one step, which bounds what a request holds where its model's window releases blocks."""
    window = info.kv_window_tokens
    committed = sum(
        request_kv_blocks(r.num_tokens, info.block_size, kv_window_tokens=window, chunk_tokens=chunk_tokens)
        for r in requests
    )
    total = info.kv_blocks_total
    # Headroom so decodes rarely force a preemption; none on an idle executor, or a request that
    # needs nearly all of its blocks (more than the headroom leaves) would wait there for good,
    # and hold up the queue behind it.
    watermark = max(1, total // 100) if requests else 0
    return ExecutorCapacity(
        executor_id=executor_id,
        free_slots=math.ceil(max(0, max_batch - len(requests)) * fraction),
        free_blocks=math.ceil(max(0, total - committed - watermark) * fraction),
        total_blocks=total,
        block_size=info.block_size,
        outstanding_tokens=sum(r.outstanding_tokens for r in requests),
        soonest_free_tokens=min((r.outstanding_tokens for r in requests), default=IDLE),
        kv_window_tokens=window,
        prefix_caching=info.prefix_caching,
        chunk_tokens=chunk_tokens,
    )


def preemptible(
    requests: Iterable[LinkedRequest], preempting: Collection[str], capacity: ExecutorCapacity
) -> list[RunningRequest]:
    """What preemption may choose from: the requests not already being preempted, each with the
    blocks it holds on the executor ``capacity`` describes."""
    return [
        RunningRequest(r.request_id, r.priority, r.preemptions, capacity.request_kv_blocks(r.num_tokens), r.generated)
        for r in requests
        if r.request_id not in preempting
    ]


def linked_request_of(
    claimed: ClaimedRequest, cached_tokens: int = 0, prefix_marks: tuple[str, ...] = ()
) -> LinkedRequest:
    # A request that wants its prompt's log probabilities computes all of it (prompt_logprobs.py).
    whole_prompt = claimed.params.prompt_logprobs is not None and not claimed.output_ids
    return LinkedRequest(
        request_id=claimed.request_id,
        prompt_len=len(claimed.prompt_ids),
        generated=len(claimed.output_ids),
        resumed_with=len(claimed.output_ids),
        arrival_ms=claimed.arrival_ms,
        assigned_ms=claimed.assigned_ms,
        first_token_ms=claimed.first_token_ms,
        priority=claimed.priority,
        preemptions=claimed.preemptions,
        deadline_ms=claimed.deadline_ms,
        expected_output=claimed.expected_output or claimed.params.max_tokens,
        cached_tokens=0 if whole_prompt else cached_tokens,
        cached_prompt_tokens=claimed.cached_prompt_tokens,
        prefix_marks=() if whole_prompt or claimed.output_ids else prefix_marks,
    )
