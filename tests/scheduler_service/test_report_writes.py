"""Step reports into Redis writes: pure logic, no server."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest

from common.lifecycle import FinishReason
from common.logprobs import Logprobs
from common.pb import executor_pb2 as pb
from scheduler_service.linked_requests import LinkedRequest
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.report_writes import ReportWrites, coalesce
from scheduler_service.requests import TokenEvent, join_runs


def linked(request_id: str, generated: int = 0) -> LinkedRequest:
    return LinkedRequest(
        request_id, prompt_len=3, generated=generated, arrival_ms=1, assigned_ms=2, first_token_ms=None
    )


def delta(request_id: str, index: int, *tokens: int) -> pb.TokenDelta:
    return pb.TokenDelta(request_id=request_id, token_ids=tokens, text="x" * len(tokens), index=index)


def sample_count(metrics: SchedulerMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_tokens_become_one_event_per_request_at_the_position_the_executor_gave() -> None:
    requests = {"a": linked("a"), "b": linked("b", generated=4)}
    metrics = SchedulerMetrics()
    writes = ReportWrites("e1", requests, metrics).of(pb.StepReport(tokens=[delta("a", 0, 7), delta("b", 4, 8, 9)]))
    assert [(w.request_id, w.event.index, w.event.token_ids) for w in writes] == [("a", 0, (7,)), ("b", 4, (8, 9))]
    assert all(w.event.finish_reason is FinishReason.NONE for w in writes)
    assert requests["b"].generated == 6 and requests["a"].first_token_ms is not None
    assert sample_count(metrics, "baton:generation_tokens_total") == 3


def test_a_finishing_request_carries_its_last_tokens_and_usage_and_leaves_the_table() -> None:
    requests = {"a": linked("a", generated=2), "b": linked("b")}
    report = pb.StepReport(
        tokens=[delta("a", 2, 5)],
        finished=[
            pb.FinishedRequest(request_id="a", finish_reason=FinishReason.LENGTH.value, text="!"),
            pb.FinishedRequest(request_id="b", finish_reason=FinishReason.ERROR.value, error="boom"),
        ],
    )
    writes = ReportWrites("e1", requests, SchedulerMetrics()).of(report)
    a, b = writes
    assert (a.event.index, a.event.token_ids, a.event.text, a.event.finish_reason) == (
        2,
        (5,),
        "x!",
        FinishReason.LENGTH,
    )
    assert a.event.usage is not None and a.event.usage["completion_tokens"] == 3
    assert (b.event.token_ids, b.event.finish_reason, b.error) == ((), FinishReason.ERROR, "boom")
    assert requests == {}


def test_requests_the_link_no_longer_holds_are_skipped() -> None:
    requests = {"a": linked("a")}
    report = pb.StepReport(
        tokens=[delta("gone", 0, 1)], finished=[pb.FinishedRequest(request_id="gone", finish_reason=1)]
    )
    assert ReportWrites("e1", requests, SchedulerMetrics()).of(report) == []


def test_inter_token_latency_is_observed_from_a_requests_second_step_on() -> None:
    requests = {"a": linked("a")}
    metrics = SchedulerMetrics()
    writes = ReportWrites("e1", requests, metrics)
    writes.of(pb.StepReport(tokens=[delta("a", 0, 1)]))
    assert sample_count(metrics, "baton:inter_token_latency_seconds_count") == 0
    writes.of(pb.StepReport(tokens=[delta("a", 1, 2)]))
    assert sample_count(metrics, "baton:inter_token_latency_seconds_count") == 1
    writes.of(pb.StepReport(tokens=[delta("a", 2, 3, 4, 5, 6)]))  # a chunk: one gap per token
    assert sample_count(metrics, "baton:inter_token_latency_seconds_count") == 5


def test_time_to_first_token_is_observed_at_the_first_token_and_never_for_a_request_without_one() -> None:
    requests = {"a": linked("a"), "b": linked("b"), "c": linked("c")}
    requests["c"].first_token_ms = 5  # resumed: its first token came on another executor
    metrics = SchedulerMetrics()
    writes = ReportWrites("e1", requests, metrics)
    writes.of(pb.StepReport(tokens=[delta("a", 0, 1), delta("c", 3, 1)]))
    assert sample_count(metrics, "baton:time_to_first_token_seconds_count") == 1  # a's, as it came
    failed = pb.FinishedRequest(request_id="b", finish_reason=FinishReason.ERROR.value, error="no token")
    writes.of(pb.StepReport(finished=[failed, pb.FinishedRequest(request_id="a", finish_reason=1)]))
    assert sample_count(metrics, "baton:time_to_first_token_seconds_count") == 1
    assert sample_count(metrics, "baton:e2e_request_latency_seconds_count") == 2
    assert sample_count(metrics, "baton:request_success_total", {"finished_reason": "error"}) == 1
    assert sample_count(metrics, "baton:request_success_total", {"finished_reason": "stop"}) == 1


def test_the_metrics_of_an_executor_that_left_are_removed() -> None:
    metrics = SchedulerMetrics()
    metrics.observe_load("gone", pb.Load(kv_blocks_used=1, kv_blocks_total=4, step_time_ns=10**6))
    labels = {"executor": "gone"}
    assert sample_count(metrics, "baton:step_time_seconds_count", labels) == 1
    metrics.forget_executor("gone")
    text = generate_latest(metrics.registry).decode()
    assert 'executor="gone"' not in text


def test_join_runs_merges_contiguous_events_up_to_a_final_one() -> None:
    usage = {"completion_tokens": 4.0}
    events = [
        TokenEvent(0, (1,), "a"),
        TokenEvent(1, (2, 3), "bc"),
        TokenEvent(5, (6,), "f"),  # a gap: stays apart
        TokenEvent(6, (), "", FinishReason.STOP, usage),
        TokenEvent(6, (9,), "z"),  # after a final event: never merged into it
    ]
    assert join_runs(events) == [
        TokenEvent(0, (1, 2, 3), "abc"),
        TokenEvent(5, (6,), "f", FinishReason.STOP, usage),
        TokenEvent(6, (9,), "z"),
    ]
    assert join_runs([]) == []


LP = Logprobs.build([5], [-0.5], [[5, 6]], [[-0.5, -1.0]])
PROMPT = Logprobs.build([1, 2], [math.nan, -2.0], [[0, 0], [2, 4]], [[math.nan, math.nan], [-2.0, -3.0]])


def test_logprobs_ride_on_their_events_and_into_the_stream_fields() -> None:
    asked = delta("a", 0, 5)
    asked.logprobs.CopyFrom(LP.to_pb())
    asked.prompt_logprobs.CopyFrom(PROMPT.to_pb())
    second = delta("a", 1, 6)
    second.logprobs.CopyFrom(Logprobs.build([6], [-0.25], [[6, 5]], [[-0.25, -2.0]]).to_pb())
    finish = pb.FinishedRequest(request_id="a", finish_reason=int(FinishReason.STOP), text="!")
    link = ReportWrites("e1", {"a": linked("a"), "b": linked("b")}, SchedulerMetrics())
    writes = link.of(pb.StepReport(tokens=[asked, delta("b", 0, 9)]))
    writes += link.of(pb.StepReport(tokens=[second], finished=[finish]))
    first, plain, last = (w.event for w in writes)
    assert first.logprobs == LP and first.prompt_logprobs is not None and first.prompt_logprobs.token_ids == (1, 2)
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert set(plain.to_fields()) == {"i", "t", "x"}  # nothing more for a request that did not ask
    assert last.finish_reason is FinishReason.STOP and last.text == "x!" and last.logprobs is not None
    merged = coalesce([w for w in writes if w.request_id == "a"])
    [one] = merged
    assert one.event.token_ids == (5, 6) and one.event.logprobs == LP.then(last.logprobs)
    back = TokenEvent.from_fields(one.event.to_fields())
    assert back.logprobs == one.event.logprobs and back.prompt_logprobs is not None
    assert back.prompt_logprobs.token_ids == (1, 2) and math.isnan(back.prompt_logprobs.logprobs[0])
    # A replayed prefix is trimmed with its logprobs; the prompt's went with the first token.
    tail = back.after(1)
    assert tail.index == 1 and tail.token_ids == (6,) and tail.logprobs == last.logprobs
    assert tail.prompt_logprobs is None


@pytest.mark.parametrize(("stop", "field"), [("\nEND", "stop_string"), (7, "stop_token_id"), (None, None)])
def test_the_stop_reason_rides_the_final_event_through_its_stream_fields(
    stop: str | int | None, field: str | None
) -> None:
    finish = pb.FinishedRequest(request_id="a", finish_reason=int(FinishReason.STOP))
    if field is not None:
        setattr(finish, field, stop)
    link = ReportWrites("e1", {"a": linked("a")}, SchedulerMetrics())
    [write] = link.of(pb.StepReport(tokens=[delta("a", 0, 5)], finished=[finish]))
    assert write.event.stop_reason == stop
    back = TokenEvent.from_fields(write.event.to_fields())
    assert back.stop_reason == stop and back.after(1).stop_reason == stop
    assert TokenEvent(0, (4,), "x").then(back).stop_reason == stop


def test_a_prompt_scored_without_output_finishes_with_its_logprobs() -> None:
    scored = pb.TokenDelta(request_id="s", index=0)
    scored.prompt_logprobs.CopyFrom(PROMPT.to_pb())
    report = pb.StepReport(
        tokens=[scored], finished=[pb.FinishedRequest(request_id="s", finish_reason=int(FinishReason.LENGTH))]
    )
    [write] = ReportWrites("e1", {"s": linked("s")}, SchedulerMetrics()).of(report)
    assert write.event.token_ids == () and write.event.finish_reason is FinishReason.LENGTH
    assert write.event.prompt_logprobs is not None and write.event.usage["completion_tokens"] == 0
