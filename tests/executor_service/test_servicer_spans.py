"""executor_service.servicer: with tracing on, every request's span ends, however its run ends."""

from __future__ import annotations

from common.lifecycle import FinishReason
from common.pb import executor_pb2 as pb
from executor_service.engine_io import FinishOut
from executor_service.servicer import ExecutorServicer
from tests.executor_service.test_token_batching import step
from tests.scheduler_service.test_tracing import in_memory_exporter


def test_spans_of_finished_preempted_and_rejected_requests_all_end() -> None:
    exporter = in_memory_exporter()
    exporter.clear()
    servicer = ExecutorServicer(tracing=True)
    servicer._start_spans(pb.Plan(admit=[pb.AdmitRequest(request_id=r) for r in ("done", "back", "full")]))
    out = step(
        1,
        finished=(FinishOut("done", FinishReason.LENGTH),),
        preempted=("back",),
        rejected=(FinishOut("full", FinishReason.NONE, error="batch full"),),
    )
    servicer._end_spans(out)
    ended = {(span.attributes or {}).get("baton.finish_reason") for span in exporter.get_finished_spans()}
    assert ended == {"LENGTH", "PREEMPTED", "REJECTED"} and servicer._spans == {}
