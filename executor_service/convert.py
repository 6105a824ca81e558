"""Protobuf <-> engine transfer objects, at the executor's gRPC edge."""

from __future__ import annotations

from common.lifecycle import FinishReason
from common.pb import executor_pb2 as pb
from common.sampling_params import SamplingParams
from common.stop_reason import write_stop_reason
from executor_service.engine_io import AdmitSpec, FinishOut, KvCacheEvents, PlanUpdate, StepOutput, TokenOut
from executor_service.load_metrics import DeviceLoad


def plan_from_pb(msg: pb.Plan) -> PlanUpdate:
    """The plan's deltas; an admit whose sampling parameters do not hold is refused for that
    request alone (``PlanUpdate.refused``), not for the plan, which carries everyone else's."""
    admits: list[AdmitSpec] = []
    refused: list[FinishOut] = []
    for a in msg.admit:
        try:
            params = SamplingParams.from_pb(a.sampling)
        except ValueError as exc:  # InvalidRequest among them
            refused.append(FinishOut(a.request_id, FinishReason.ERROR, error=f"invalid sampling parameters: {exc}"))
            continue
        admits.append(
            AdmitSpec(
                request_id=a.request_id,
                prompt_ids=tuple(a.prompt_token_ids),
                output_ids=tuple(a.output_token_ids),
                params=params,
                rank=a.rank,
                prefix_root=a.prefix_root,
            )
        )
    return PlanUpdate(
        seq=msg.seq,
        iteration=msg.iteration,
        admit=tuple(admits),
        refused=tuple(refused),
        abort=tuple(msg.abort),
        preempt=tuple(msg.preempt),
        grants={g.request_id: g.num_tokens for g in msg.prefill},
        expected_cached={g.request_id: g.expected_cached for g in msg.prefill if g.expected_cached},
        token_budget=msg.token_budget,
    )


def _delta_pb(out: TokenOut) -> pb.TokenDelta:
    msg = pb.TokenDelta(request_id=out.request_id, token_ids=out.token_ids, text=out.text, index=out.output_index)
    if out.logprobs is not None:  # only requests that asked pay for these
        msg.logprobs.CopyFrom(out.logprobs.to_pb())
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs.CopyFrom(out.prompt_logprobs.to_pb())
    if out.num_cached is not None:
        msg.cached_tokens = out.num_cached
    return msg


def _finish_pb(out: FinishOut) -> pb.FinishedRequest:
    msg = pb.FinishedRequest(request_id=out.request_id, finish_reason=int(out.reason), text=out.text, error=out.error)
    write_stop_reason(msg, out.stop_reason)
    return msg


def _kv_events_pb(events: KvCacheEvents) -> pb.KvCacheEvents | None:
    if not events:
        return None  # unset: nothing changed
    return pb.KvCacheEvents(cleared=events.cleared, stored=events.stored, removed=events.removed)


def report_to_pb(out: StepOutput, device: DeviceLoad) -> pb.StepReport:
    return pb.StepReport(
        iteration=out.iteration,
        plan_seq=out.plan_seq,
        tokens=[_delta_pb(t) for t in out.tokens],
        finished=[_finish_pb(f) for f in out.finished],
        preempted=list(out.preempted),
        rejected=[_finish_pb(f) for f in out.rejected],
        load=pb.Load(
            num_running=out.num_running,
            kv_blocks_used=out.kv_blocks_used,
            kv_blocks_total=out.kv_blocks_total,
            step_time_ns=out.step_time_ns,
            num_tokens=out.num_tokens,
            source=device.source,
            utilization_pct=device.utilization_pct,
            memory_used_bytes=device.memory_used_bytes,
            memory_total_bytes=device.memory_total_bytes,
            power_watts=device.power_watts,
            pending_prefill_tokens=out.pending_prefill_tokens,
            prefix_cache_queries=out.prefix_cache_queries,
            prefix_cache_hits=out.prefix_cache_hits,
        ),
        kv_events=_kv_events_pb(out.kv_events),
    )
