"""Client auth at the gateway: API keys from the scheduler's tokens file, the tenant from the key, and
the caller's own key forwarded to a scheduler with auth on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from baton.cli import build_parser
from baton.client_commands import tls_credentials
from common.security import load_tokens
from tests.conftest import RedisServer
from tests.gateway.serving import serve_gateway
from tests.scheduler_service.test_security import make_pki, mtls_security
from tests.stack import Stack, stack_config, start_stack

TOKENS = "tok-alice: alice\ntok-bob: bob\ntok-admin: '*'\n"


@dataclass
class Gateways:
    stack: Stack
    redis_url: str
    checking: str  # base URL of a gateway given the tokens file: it checks keys itself
    forwarding: str  # base URL of a gateway without it: the scheduler alone checks the forwarded key

    @property
    def model(self) -> str:
        """The served model's name, as the executors registered it."""
        return self.stack.config.executor.model

    def client(self, base_url: str, key: str, **kwargs: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
async def gateways(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Gateways]:
    redis_server.flush()
    tokens = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    tokens.write_text(TOKENS)
    config = stack_config(redis_server.url, tiny_model_dir, security={"auth_tokens_file": str(tokens)})
    stack = await start_stack(config)
    try:
        async with (
            serve_gateway(stack.target, load_tokens(str(tokens))) as checking,
            serve_gateway(stack.target) as forwarding,
        ):
            yield Gateways(stack, redis_server.url, checking, forwarding)
    finally:
        await stack.stop()


async def _tenant(gateways: Gateways, completion_id: str) -> str:
    store = aioredis.Redis.from_url(gateways.redis_url, decode_responses=True)
    try:
        return str(await store.hget(f"{{baton}}:req:{completion_id.removeprefix('cmpl-')}", "tenant"))  # type: ignore[misc]
    finally:
        await store.aclose()


async def test_no_or_unknown_key_is_401_and_health_stays_open(gateways: Gateways) -> None:
    body = {"model": gateways.model, "prompt": "Hi", "max_tokens": 2}
    chat = {"model": gateways.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for base_url in (gateways.checking, gateways.forwarding):
        async with httpx.AsyncClient(base_url=base_url) as http:
            # A tenant header from a caller without a key is never trusted: still a 401.
            anonymous = await http.post("/v1/completions", json=body, headers={"x-baton-tenant": "alice"})
            wrong = await http.post("/v1/chat/completions", json=chat, headers={"authorization": "Bearer nope"})
            models = await http.get("/v1/models")
            tokenize = await http.post("/tokenize", json={"prompt": "Hi"})
            detokenize = await http.post("/detokenize", json={"tokens": [5]}, headers={"authorization": "Bearer nope"})
            health = await http.get("/health")
            metrics = await http.get("/metrics")  # open as /health is: counts, nothing a request said
        assert metrics.status_code == 200 and "baton:gateway_requests_total" in metrics.text
        for reply in (anonymous, wrong, models, tokenize, detokenize):
            assert reply.status_code == 401, (base_url, reply.text)
            assert reply.headers["www-authenticate"] == "Bearer"
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert health.status_code == 200 and health.json()["status"] == "SERVING"
    async with gateways.client(gateways.checking, "nope") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model=gateways.model, prompt="Hi", max_tokens=2)


async def test_a_key_runs_as_its_tenant_whatever_the_body_or_headers_say(gateways: Gateways) -> None:
    for base_url in (gateways.checking, gateways.forwarding):
        async with gateways.client(base_url, "tok-alice") as client:
            out = await client.completions.create(
                model=gateways.model,
                prompt="Hi",
                max_tokens=3,
                extra_body={"ignore_eos": True},
                extra_headers={"x-baton-tenant": "alice"},
            )
            assert out.usage is not None and out.usage.completion_tokens == 3
            assert await _tenant(gateways, out.id) == "alice"
            with pytest.raises(openai.PermissionDeniedError):
                await client.completions.create(
                    model=gateways.model, prompt="Hi", max_tokens=2, extra_headers={"x-baton-tenant": "bob"}
                )
            assert [m.object for m in (await client.models.list()).data] == ["model"]
    async with gateways.client(gateways.checking, "tok-alice") as client:
        # OpenAI's `user` is an end-user id: with the gateway checking keys it never names the tenant.
        out = await client.completions.create(model=gateways.model, prompt="Hi", max_tokens=2, user="bob")
        assert await _tenant(gateways, out.id) == "alice"
        stream = await client.chat.completions.create(
            model=gateways.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason is not None


async def test_an_admin_key_acts_for_the_tenant_the_header_names(gateways: Gateways) -> None:
    async with gateways.client(gateways.checking, "tok-admin") as client:
        out = await client.completions.create(
            model=gateways.model, prompt="Hi", max_tokens=2, extra_headers={"x-baton-tenant": "bob"}
        )
    assert await _tenant(gateways, out.id) == "bob"


def test_an_empty_tokens_file_stops_the_gateway_instead_of_serving_everyone(tmp_path: Path) -> None:
    empty = tmp_path / "tokens.yaml"
    empty.write_text("")
    args = build_parser().parse_args(["gateway", "--port", "0", "--auth-tokens-file", str(empty)])
    assert args.func(args) == 2


async def test_anthropic_clients_send_their_key_as_x_api_key(gateways: Gateways) -> None:
    body = {"model": gateways.model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    for base_url in (gateways.checking, gateways.forwarding):
        async with httpx.AsyncClient(base_url=base_url) as http:
            keyed = await http.post("/v1/messages", json=body, headers={"x-api-key": "tok-bob"})
            wrong = await http.post("/v1/messages", json=body, headers={"x-api-key": "nope"})
        assert keyed.status_code == 200, keyed.text
        assert await _tenant(gateways, keyed.json()["id"].removeprefix("msg_")) == "bob"
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"


async def test_the_gateway_dials_a_scheduler_that_serves_mtls(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Every gRPC hop can be encrypted, the gateway's to the scheduler too (``--tls-ca``,
    ``--tls-cert``, ``--tls-key``, as the other client commands take them). A Redis of its own: the
    module's stack runs on the shared one, and its executor would share this one's id."""
    redis = RedisServer(tmp_path)
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    stack = await start_stack(stack_config(redis.url, tiny_model_dir, security=mtls_security(pki)))
    args = build_parser().parse_args(
        [
            "gateway",
            "--tls-ca",
            str(pki["ca"]),
            "--tls-cert",
            str(pki["client_cert"]),
            "--tls-key",
            str(pki["client_key"]),
        ]
    )
    try:
        async with serve_gateway(stack.target, credentials=tls_credentials(args)) as base_url:
            client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
            answer = await client.completions.create(model=stack.config.executor.model, prompt="Hi", max_tokens=3)
            await client.close()
            assert answer.usage is not None and answer.usage.completion_tokens == 3
        async with serve_gateway(stack.target) as base_url, httpx.AsyncClient() as http:
            assert (await http.get(f"{base_url}/health")).status_code == 503  # plaintext: the scheduler refuses it
    finally:
        await stack.stop()
        redis.stop()
