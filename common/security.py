"""TLS credentials, bearer-token auth and the fleet secret, shared by the services and the gateway.

Auth maps each bearer token to a tenant (a YAML/JSON file ``token: tenant``; ``"*"`` is an admin
that may act for any tenant). The interceptor puts the caller's principal in a context variable,
so the Generation logic can keep tenants apart without every handler passing it around.

The fleet secret guards the executors' port: schedulers send it on every call
(``fleet_metadata``), and ``FleetSecretInterceptor`` refuses calls without it before any servicer
code runs, so a stranger's Run stream can never supersede the executor's scheduler.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from common.config import SecurityConfig, check_fleet_secret
from common.keys import check_name

ADMIN_TENANT = "*"
# Health checks and reflection stay open: orchestrators probe them without credentials.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Call metadata carrying the fleet secret from a scheduler to an executor.
FLEET_SECRET_KEY = "x-baton-fleet-secret"


@dataclass(frozen=True)
class Principal:
    tenant: str

    @property
    def is_admin(self) -> bool:
        return self.tenant == ADMIN_TENANT


current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("principal", default=None)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS for a listening port (mTLS when ``require_client_cert``); None means plaintext."""
    if not config.tls_cert:
        return None
    root = _read(config.tls_ca) if config.tls_ca else None
    return grpc.ssl_server_credentials(
        [(_read(config.tls_key), _read(config.tls_cert))],
        root_certificates=root,
        require_client_auth=config.require_client_cert,
    )


def channel_credentials(config: SecurityConfig) -> grpc.ChannelCredentials | None:
    """TLS for dialing another Baton service (the scheduler to its executors); None means plaintext."""
    if not config.tls_ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca),
        private_key=_read(config.client_key) if config.client_key else None,
        certificate_chain=_read(config.client_cert) if config.client_cert else None,
    )


def fleet_secret(config: SecurityConfig) -> str:
    """The configured fleet secret, read from ``fleet_secret_file`` when that is set; "" when off."""
    if not config.fleet_secret_file:
        return config.fleet_secret
    # A configured file that is empty must not quietly turn the check off.
    secret = Path(config.fleet_secret_file).read_text().strip()
    check_fleet_secret(secret, config.fleet_secret_file)
    return secret


def fleet_metadata(config: SecurityConfig) -> tuple[tuple[str, str], ...]:
    """What a scheduler sends on each call to an executor: the fleet secret, when there is one."""
    secret = fleet_secret(config)
    return ((FLEET_SECRET_KEY, secret),) if secret else ()


def load_tokens(path: str) -> dict[str, str]:
    if not path:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"{path}: the auth tokens file must map token strings to tenant strings")
    for tenant in data.values():
        if tenant != ADMIN_TENANT:
            check_name(tenant, f"{path}: a tenant")  # tenants become parts of Redis keys
    return data


def _denied(code: grpc.StatusCode, message: str, like: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``like`` that refuses every call."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield None  # pragma: no cover - abort raises

    if like.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(stream)
    if like.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


def bearer_token(authorization: str) -> str:
    """The token of an ``Authorization: Bearer TOKEN`` value; "" for any other scheme or none."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class TokenTable:
    """Bearer tokens and their tenants, compared in constant time (no timing hints about a token)."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tokens = [(token.encode(), tenant) for token, tenant in tokens.items()]

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def principal(self, presented: str) -> Principal | None:
        """The tenant ``presented`` maps to, or None for an unknown (or empty) token."""
        if not presented:
            return None
        for token, tenant in self._tokens:
            if hmac.compare_digest(token, presented.encode()):
                return Principal(tenant)
        return None


class _CallGate(grpc.aio.ServerInterceptor):
    """Checks every call but health and reflection before any servicer code runs; covers streams too."""

    def _admit(self, handler: grpc.RpcMethodHandler, metadata: Any) -> grpc.RpcMethodHandler:
        """``handler`` to run the call, or a handler that refuses it."""
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        return self._admit(handler, details.invocation_metadata)


class BearerAuthInterceptor(_CallGate):
    """``authorization: Bearer TOKEN`` on every call but health and reflection."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tokens = TokenTable(tokens)

    def _principal(self, metadata: Any) -> Principal | None:
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                return self._tokens.principal(value[len("Bearer ") :].strip())
        return None

    def _admit(self, handler: grpc.RpcMethodHandler, metadata: Any) -> grpc.RpcMethodHandler:
        principal = self._principal(metadata)
        if principal is None:
            return _denied(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required", handler)
        return _with_principal(handler, principal)


class FleetSecretInterceptor(_CallGate):
    """The fleet secret (``x-baton-fleet-secret``) on every call but health and reflection.

    A refused call never reaches the servicer: a Run stream without the secret attaches nothing,
    so it cannot supersede the stream of the scheduler now driving the executor.
    """

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("FleetSecretInterceptor needs a non-empty secret")
        self._secret = secret.encode()

    def _admit(self, handler: grpc.RpcMethodHandler, metadata: Any) -> grpc.RpcMethodHandler:
        presented = next((v for k, v in metadata or () if k == FLEET_SECRET_KEY and isinstance(v, str)), None)
        if presented is not None and hmac.compare_digest(self._secret, presented.encode()):
            return handler
        return _denied(grpc.StatusCode.UNAUTHENTICATED, "the fleet secret is missing or wrong", handler)


def _with_principal(handler: grpc.RpcMethodHandler, principal: Principal) -> grpc.RpcMethodHandler:
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            current_principal.set(principal)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _streaming_as(principal, handler.unary_stream), handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            _streaming_as(principal, handler.stream_stream), handler.request_deserializer, handler.response_serializer
        )
    raise ValueError("client-streaming methods are not served behind auth")  # none exist: fail loudly


def _streaming_as(
    principal: Principal, inner: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """A response-streaming handler run as ``principal`` (tasks it starts copy the context)."""

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        current_principal.set(principal)
        async for item in inner(request, context):
            yield item

    return stream
