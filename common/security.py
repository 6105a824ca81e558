"""TLS credentials and bearer-token auth, shared by both services.

Auth maps each bearer token to a tenant (a YAML/JSON file ``token: tenant``; ``"*"`` is an admin
that may act for any tenant). The interceptor puts the caller's principal in a context variable,
so the Generation logic can keep tenants apart without every handler passing it around.
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

from common.config import SecurityConfig

ADMIN_TENANT = "*"
# Health checks and reflection stay open: orchestrators probe them without credentials.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


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


def load_tokens(path: str) -> dict[str, str]:
    if not path:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"{path}: the auth tokens file must map token strings to tenant strings")
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


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """``authorization: Bearer TOKEN`` on every call but health and reflection; covers streams too."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tokens = dict(tokens)

    def _principal(self, metadata: Any) -> Principal | None:
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                presented = value[len("Bearer ") :].strip()
                for token, tenant in self._tokens.items():
                    if hmac.compare_digest(token.encode(), presented.encode()):
                        return Principal(tenant)
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        principal = self._principal(details.invocation_metadata)
        if principal is None:
            return _denied(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required", handler)
        return _with_principal(handler, principal)


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
