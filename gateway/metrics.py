"""The gateway's own Prometheus metrics, served on its HTTP port at ``/metrics`` as vLLM's API
server serves its own: requests by route and status, their latency to the last byte (a stream's
included), and those in flight. The engine's figures are the scheduler's and executors' metrics.

``HttpMetrics`` is a plain ASGI middleware, so a streamed answer is timed to its end, not to its
first chunk. A request is labelled by the route it matched (``/v1/models/{model:path}``, not the
model it named); anything else counts as ``other``, so no client can grow the label set.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.metrics import LATENCY_BUCKETS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class GatewayMetrics:
    def __init__(self, routes: list[Route]) -> None:
        self.routes = routes
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "baton:gateway_requests", "HTTP requests answered, by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "baton:gateway_request_duration_seconds",
            "From a request's arrival to its answer's last byte, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "baton:gateway_requests_in_flight", "Requests being answered, by route", ["route"], registry=r
        )

    def route(self, path: str) -> str:
        """The label of a request for ``path``: its route's path, or "other"."""
        return next((route.path for route in self.routes if route.path_regex.match(path)), "other")

    async def endpoint(self, request: Request) -> Response:
        """``GET /metrics``: open like ``/health`` (counts only, nothing a request said)."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class HttpMetrics:
    """ASGI middleware recording each HTTP request in ``metrics``."""

    def __init__(self, app: App, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = self.metrics
        route = metrics.route(scope.get("path", ""))
        started = time.perf_counter()
        status = 500  # an answer that never started is an error
        in_flight = metrics.in_flight.labels(route)
        in_flight.inc()

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            in_flight.dec()
            metrics.requests.labels(route, str(status)).inc()
            metrics.latency.labels(route).observe(time.perf_counter() - started)
