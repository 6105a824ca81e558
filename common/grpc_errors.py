"""One interceptor maps domain errors to gRPC status codes, for unary and streaming handlers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from redis.exceptions import ClusterDownError, ReadOnlyError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import errors

log = logging.getLogger(__name__)

STATUS_FOR: dict[type[BaseException], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NotReady: grpc.StatusCode.UNAVAILABLE,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    RedisConnectionError: grpc.StatusCode.UNAVAILABLE,
    RedisTimeoutError: grpc.StatusCode.UNAVAILABLE,
    # A Redis Cluster or Sentinel failover in progress: transient, like a lost connection.
    ClusterDownError: grpc.StatusCode.UNAVAILABLE,
    TryAgainError: grpc.StatusCode.UNAVAILABLE,
    ReadOnlyError: grpc.StatusCode.UNAVAILABLE,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for kind, code in STATUS_FOR.items():
        if isinstance(exc, kind):
            message = str(exc) if isinstance(exc, errors.BatonError) else "storage unavailable, retry"
            return code, message
    return grpc.StatusCode.INTERNAL, "internal error"


RETRY_AFTER_METADATA = "retry-after-ms"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in %s", method, exc_info=exc)
    if isinstance(exc, errors.Overloaded) and exc.retry_after_ms:
        # The hint rides twice: as google.rpc.RetryInfo in the standard status details (what
        # gRPC clients' retry policies read) and as plain trailing metadata for simple clients.
        await context.abort_with_status(_overloaded_status(code, message, exc.retry_after_ms))
    await context.abort(code, message)


def _overloaded_status(code: grpc.StatusCode, message: str, retry_after_ms: int) -> grpc.Status:
    detail = any_pb2.Any()
    retry = error_details_pb2.RetryInfo()
    retry.retry_delay.FromMilliseconds(retry_after_ms)
    detail.Pack(retry)
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    rich = rpc_status.to_status(status)
    metadata = (*rich.trailing_metadata, (RETRY_AFTER_METADATA, str(retry_after_ms)))
    return _Status(rich.code, rich.details, metadata)


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, Any], ...]) -> None:
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


class _Undecodable:
    """Stands in for a request protobuf could not parse (e.g. a string field with invalid UTF-8)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    # A deserializer that raises makes grpc answer INTERNAL; bad bytes are the client's error.
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(exc)

    return deserialize


def check_decoded(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise errors.InvalidRequest(f"the request could not be decoded: {request.error}")


def _mapped_stream(
    inner: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]], method: str, check_request: bool
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """``inner``, a response-streaming handler, with its domain errors mapped to status codes."""

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            if check_request:
                check_decoded(request)
            async for item in inner(request, context):
                yield item
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc, method)

    return stream


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain errors to status codes and undecodable requests to INVALID_ARGUMENT.

    ``checked_streams`` names the bidirectional methods whose handlers check each message they
    read (``check_decoded``), so that one bad message fails only itself; any other stream keeps
    grpc's own decoding.
    """

    def __init__(self, checked_streams: tuple[str, ...] = ()) -> None:
        self._checked_streams = frozenset(checked_streams)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    check_decoded(request)
                    return await inner_uu(request, context)
                except Exception as exc:
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await _abort(context, exc, method)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, _lenient(handler.request_deserializer), handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _mapped_stream(handler.unary_stream, method, check_request=True),
                _lenient(handler.request_deserializer),
                handler.response_serializer,
            )
        if handler.stream_stream is not None and method in self._checked_streams:
            # The handler checks each message it reads, so its requests are not checked here.
            return grpc.stream_stream_rpc_method_handler(
                _mapped_stream(handler.stream_stream, method, check_request=False),
                _lenient(handler.request_deserializer),
                handler.response_serializer,
            )
        return handler
