"""TLS (mTLS) on every gRPC hop, bearer-token auth on the public API, tenant isolation, Redis password."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from tests.conftest import RedisServer, free_port
from tests.stack import Stack, stack_config, start_stack


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(root: Path) -> dict[str, Path]:
    """A throwaway CA, a server cert for 127.0.0.1/localhost and a client cert, all signed by the CA."""
    ca_key, ca_cert = root / "ca.key", root / "ca.pem"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca_cert),
        "-days",
        "1",
        "-subj",
        "/CN=baton-test-ca",
    )
    paths = {"ca": ca_cert}
    for name, san in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "subjectAltName=DNS:client")):
        key, csr, cert, ext = root / f"{name}.key", root / f"{name}.csr", root / f"{name}.pem", root / f"{name}.ext"
        ext.write_text(san + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca_cert),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-out",
            str(cert),
            "-days",
            "1",
            "-extfile",
            str(ext),
        )
        paths[f"{name}_cert"], paths[f"{name}_key"] = cert, key
    return paths


def mtls_security(pki: dict[str, Path]) -> dict[str, object]:
    """The ``security`` section of a fleet on mutual TLS: every hop's server and client certificates."""
    return {
        "tls_cert": str(pki["server_cert"]),
        "tls_key": str(pki["server_key"]),
        "tls_ca": str(pki["ca"]),
        "require_client_cert": True,
        "client_cert": str(pki["client_cert"]),
        "client_key": str(pki["client_key"]),
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def secure_stack(
    redis_url: str, tiny_model_dir: Path, pki: dict[str, Path], tmp_path: Path
) -> AsyncIterator[Stack]:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tok-alice: alice\ntok-bob: bob\ntok-admin: '*'\n")
    security = {**mtls_security(pki), "auth_tokens_file": str(tokens)}
    stack = await start_stack(stack_config(redis_url, tiny_model_dir, security=security))
    await stack.channel.close()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki["ca"].read_bytes(),
        private_key=pki["client_key"].read_bytes(),
        certificate_chain=pki["client_cert"].read_bytes(),
    )
    stack.channel = grpc.aio.secure_channel(stack.target, credentials)
    yield stack
    await stack.stop()


def auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def short(request_id: str = "", tenant: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id, prompt="hello", tenant=tenant, params=pb.SamplingParams(max_tokens=3, ignore_eos=True)
    )


async def _code(awaitable: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable  # type: ignore[misc]
    return info.value.code()


async def test_requests_without_a_valid_token_are_unauthenticated(secure_stack: Stack) -> None:
    stub = secure_stack.stub
    assert await _code(stub.Complete(short())) == grpc.StatusCode.UNAUTHENTICATED
    assert await _code(stub.Complete(short(), metadata=auth("wrong"))) == grpc.StatusCode.UNAUTHENTICATED

    async def stream() -> None:
        async for _ in stub.Generate(short()):
            pass

    assert await _code(stream()) == grpc.StatusCode.UNAUTHENTICATED

    async def batch() -> None:
        async for _ in stub.GenerateBatch(iter([short()])):
            pass

    assert await _code(batch()) == grpc.StatusCode.UNAUTHENTICATED


async def test_a_batch_stream_runs_as_its_tokens_tenant(secure_stack: Stack) -> None:
    requests = [short("alice-batch"), short(tenant="bob")]
    events = [
        e async for m in secure_stack.stub.GenerateBatch(iter(requests), metadata=auth("tok-alice")) for e in m.events
    ]
    record = await secure_stack.scheduler.frontend.store.requests.get("alice-batch")
    assert record is not None and record["tenant"] == "alice"
    refused = [e for e in events if e.position == 1]
    assert len(refused) == 1 and refused[0].error_code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert sum(len(e.response.token_ids) for e in events if e.position == 0) == 3


async def test_a_token_is_served_and_pins_its_tenant(secure_stack: Stack) -> None:
    reply = await secure_stack.stub.Complete(short("alice-1"), metadata=auth("tok-alice"))
    assert len(reply.token_ids) == 3
    record = await secure_stack.scheduler.frontend.store.requests.get("alice-1")
    assert record is not None and record["tenant"] == "alice"
    code = await _code(secure_stack.stub.Complete(short(tenant="bob"), metadata=auth("tok-alice")))
    assert code == grpc.StatusCode.PERMISSION_DENIED


async def test_a_tenant_cannot_read_cancel_or_resume_another_tenants_request(secure_stack: Stack) -> None:
    stub = secure_stack.stub
    await stub.Complete(short("alice-2"), metadata=auth("tok-alice"))
    bob = auth("tok-bob")
    assert await _code(stub.GetRequest(pb.GetRequestRequest(request_id="alice-2"), metadata=bob)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert await _code(stub.Cancel(pb.CancelRequest(request_id="alice-2"), metadata=bob)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )

    async def resume() -> None:
        async for _ in stub.Resume(pb.ResumeRequest(request_id="alice-2"), metadata=bob):
            pass

    assert await _code(resume()) == grpc.StatusCode.PERMISSION_DENIED
    own = await stub.GetRequest(pb.GetRequestRequest(request_id="alice-2"), metadata=auth("tok-alice"))
    assert own.state == pb.REQUEST_STATE_FINISHED
    admin = await stub.GetRequest(pb.GetRequestRequest(request_id="alice-2"), metadata=auth("tok-admin"))
    assert admin.state == pb.REQUEST_STATE_FINISHED


async def test_plaintext_and_certless_clients_are_refused(secure_stack: Stack, pki: dict[str, Path]) -> None:
    async with grpc.aio.insecure_channel(secure_stack.target) as plain:
        code = await _code(generate_pb2_grpc.GenerationStub(plain).Complete(short(), metadata=auth("tok-alice")))
        assert code == grpc.StatusCode.UNAVAILABLE
    no_cert = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
    async with grpc.aio.secure_channel(secure_stack.target, no_cert) as channel:
        code = await _code(generate_pb2_grpc.GenerationStub(channel).Complete(short(), metadata=auth("tok-alice")))
        assert code == grpc.StatusCode.UNAVAILABLE


async def test_health_stays_open_without_a_token(secure_stack: Stack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = await health_pb2_grpc.HealthStub(secure_stack.channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_redis_with_a_password(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--requirepass",
            "s3cret",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        RedisServer._wait_ready_on(port)  # type: ignore[attr-defined]
        stack = await start_stack(stack_config(f"redis://:s3cret@127.0.0.1:{port}/0", tiny_model_dir))
        try:
            reply = await stack.stub.Complete(short())
            assert len(reply.token_ids) == 3
        finally:
            await stack.stop()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
