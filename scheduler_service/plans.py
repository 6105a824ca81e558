"""What a plan carries for newly admitted requests: each one's full data, once, and the prefill
tokens each may compute in the plan's first step."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from common.pb import executor_pb2 as pb
from scheduler_service.requests import ClaimedRequest


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
        prefix_root=claimed.prefix_root,
    )


def prefill_grants(
    admits: Iterable[pb.AdmitRequest], budget: int, max_chunk: int, cached: Mapping[str, int] | None = None
) -> list[pb.PrefillGrant]:
    """Prefill tokens for the newly admitted, in plan order, from what the step budget leaves.

    ``cached``: request id -> the prefix its executor is expected to find in its prefix cache.
    Only the rest is computed, so only the rest is granted and spends the budget (at least one
    token: the last is always computed, for the first output's logits)."""
    cached = cached or {}
    grants: list[pb.PrefillGrant] = []
    for admit in admits:
        if budget <= 0:
            break
        total = len(admit.prompt_token_ids) + len(admit.output_token_ids)
        expected = cached.get(admit.request_id, 0)
        grant = min(budget, max(1, total - expected), max_chunk)
        grants.append(pb.PrefillGrant(request_id=admit.request_id, num_tokens=grant, expected_cached=expected))
        budget -= grant
    return grants
