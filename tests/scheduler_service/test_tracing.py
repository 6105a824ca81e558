"""OpenTelemetry: one trace from the client call through the scheduler to the executor's span."""

from __future__ import annotations

from pathlib import Path

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from common.tracing import REQUEST_ID, client_interceptors
from tests.stack import eventually, stack_config, start_stack


def in_memory_exporter() -> InMemorySpanExporter:
    """Install (once per process) an SDK provider that keeps finished spans in memory."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


async def test_one_trace_spans_client_scheduler_and_executor(redis_url: str, tiny_model_dir: Path) -> None:
    exporter = in_memory_exporter()
    stack = await start_stack(stack_config(redis_url, tiny_model_dir, monitoring={"tracing": True}))
    try:
        async with grpc.aio.insecure_channel(stack.target, interceptors=client_interceptors(True)) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(request_id="traced-1", prompt="hello", params=pb.SamplingParams(max_tokens=3))
            await stub.Complete(request)

        async def executor_span_ended() -> bool:
            return any(s.name == "baton.executor.request" for s in exporter.get_finished_spans())

        await eventually(executor_span_ended, "the executor's span to end")
    finally:
        await stack.stop()
    spans = exporter.get_finished_spans()
    tagged = [s for s in spans if (s.attributes or {}).get(REQUEST_ID) == "traced-1"]
    names = {s.name for s in tagged}
    assert "/baton.v1.Generation/Complete" in names, names
    assert "baton.executor.request" in names, names
    traces = {s.context.trace_id for s in tagged}
    assert len(traces) == 1  # scheduler and executor spans share the client's trace
    client = [s for s in spans if s.kind == trace.SpanKind.CLIENT and s.name.endswith("/Complete")]
    assert client and client[0].context.trace_id in traces
