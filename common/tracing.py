"""Optional OpenTelemetry tracing across gateway -> scheduler -> executor (off by default).

gRPC calls carry W3C trace context in their metadata (opentelemetry-instrumentation-grpc). The
scheduler -> executor hop is one long-lived stream, not a call per request, so each request's
trace context travels inside the plan instead (``AdmitRequest.traceparent``) and the executor
opens a span per request under it. Every span carries the request id as ``baton.request_id``.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

REQUEST_ID = "baton.request_id"
_PROPAGATOR = TraceContextTextMapPropagator()


def setup_tracing(service_name: str, enabled: bool, otlp_endpoint: str = "") -> bool:
    """Install a tracer provider for this process when tracing is on; return whether it is on.

    A provider someone already installed (a test's in-memory one, an auto-instrumentation agent)
    is kept. With ``otlp_endpoint`` set, spans go there (needs opentelemetry-exporter-otlp).
    """
    if not enabled:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return True
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    trace.set_tracer_provider(provider)
    log.info("tracing on for %s (exporter: %s)", service_name, otlp_endpoint or "none configured")
    return True


# The scheduler <-> executor Run stream lives as long as the link and is written with
# ``context.write`` (not an async generator), which the OpenTelemetry interceptor cannot wrap;
# each request on it gets its own span from the traceparent its plan carries.
UNTRACED_METHODS = ("/baton.v1.Executor/Run",)


def server_interceptors(enabled: bool) -> list[Any]:
    if not enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

    untraced = filters.any_of(*(filters.full_method_name(name) for name in UNTRACED_METHODS))
    return [aio_server_interceptor(filter_=filters.negate(untraced))]


def client_interceptors(enabled: bool) -> list[Any]:
    if not enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())


def tag_current_span(request_id: str) -> None:
    trace.get_current_span().set_attribute(REQUEST_ID, request_id)


def current_traceparent() -> str:
    """The current span's W3C ``traceparent``, or "" when there is no active trace."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", "")


def start_request_span(name: str, request_id: str, traceparent: str) -> trace.Span:
    """A span for one request, child of the trace that ``traceparent`` names (if any)."""
    parent = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else context.get_current()
    span = trace.get_tracer("baton").start_span(name, context=parent)
    span.set_attribute(REQUEST_ID, request_id)
    return span
