"""The gateway's own Prometheus metrics, on its HTTP port as vLLM's API server serves them."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from tests.conftest import free_port


async def test_requests_are_counted_by_route_status_and_time() -> None:
    app = create_app(f"127.0.0.1:{free_port()}")  # nothing answers there: generation routes are 503
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
            for path in ("/version", "/version", "/no/such/route", "/v1/models/a-model"):
                await http.get(path)
            text = (await http.get("/metrics")).text
    finally:
        await app.state.gateway.close()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    count = "baton:gateway_requests_total"
    assert samples[(count, (("route", "/version"), ("status", "200")))] == 2
    assert samples[(count, (("route", "other"), ("status", "404")))] == 1  # no client grows the labels
    assert samples[(count, (("route", "/v1/models/{model:path}"), ("status", "503")))] == 1
    assert samples[("baton:gateway_request_duration_seconds_count", (("route", "/version"),))] == 2
    assert samples[("baton:gateway_requests_in_flight", (("route", "/version"),))] == 0
