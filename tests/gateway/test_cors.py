"""Cross-origin requests from browsers, as vLLM's server answers them."""

from __future__ import annotations

import httpx
import pytest

from baton.cli import build_parser
from gateway.app import create_app
from gateway.cors import CorsPolicy, string_list
from tests.conftest import free_port

PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}


async def _answers(cors: CorsPolicy) -> tuple[httpx.Response, httpx.Response]:
    """A preflight for a chat request, and a simple cross-origin GET, from https://app.example."""
    app = create_app(f"127.0.0.1:{free_port()}", cors=cors)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
            preflight = await http.options("/v1/chat/completions", headers=PREFLIGHT)
            simple = await http.get("/version", headers={"Origin": "https://app.example"})
    finally:
        await app.state.gateway.close()
    return preflight, simple


async def test_any_origin_may_call_by_default() -> None:
    preflight, simple = await _answers(CorsPolicy())
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == "*"


async def test_the_allowed_origins_narrow_it() -> None:
    preflight, simple = await _answers(CorsPolicy(origins=("https://other.example",)))
    assert preflight.status_code == 400 and "access-control-allow-origin" not in simple.headers


def test_the_flags_take_json_lists_as_vllm_s() -> None:
    args = build_parser().parse_args(["gateway", "--allowed-origins", '["https://app.example"]'])
    assert string_list(args.allowed_origins) == ("https://app.example",)
    assert string_list(args.allowed_methods) == ("*",) and not args.allow_credentials
    with pytest.raises(ValueError, match="JSON list"):
        string_list("https://app.example")
