"""Prometheus plumbing both services share: a private registry per service and its /metrics server.

Each service instance owns a registry (not prometheus_client's global one), so several services
can live in one process, as they do in tests.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# A request's whole times (first token, queue, end to end) under load or for long outputs run
# to minutes; vLLM's buckets for them reach 2,560 s and 7,680 s.
REQUEST_LATENCY_BUCKETS = (*LATENCY_BUCKETS, 240.0, 480.0, 960.0, 1920.0, 3840.0, 7680.0)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> int:
    """Serve /metrics on ``port`` (0 disables it); return the port, or 0."""
    if port <= 0:
        return 0
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_address[1])
    log.info("Prometheus metrics on :%d/metrics", bound)
    return bound
