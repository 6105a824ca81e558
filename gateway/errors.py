"""HTTP errors in OpenAI's shape, and the mapping from gRPC status codes to them."""

from __future__ import annotations

from typing import Any

import grpc
from starlette.responses import JSONResponse

HTTP_STATUS_FOR: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    # The served model cannot do what was asked (a chat for a model without a chat template): the
    # request is wrong for this server, as vLLM answers it too.
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# OpenAI clients pick their exception class from the HTTP status; `type` is for humans and logs.
_ERROR_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI answers for a bad API key
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error answered with an HTTP status and an OpenAI-style JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        error_type: str | None = None,
    ) -> None:
        """``error_type``: the body's ``type``, when not the one usual for ``status``."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.error_type = error_type or _ERROR_TYPE.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class BadRequest(GatewayError):
    """The HTTP request itself is malformed or asks for something Baton cannot do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message, code="invalid_request", param=param)


class ModelNotFound(GatewayError):
    """The request names a model not served here: OpenAI's 404, with its type and code."""

    def __init__(self, model: str) -> None:
        super().__init__(
            404,
            f"the model {model!r} does not exist or is not served here",
            code="model_not_found",
            param="model",
            error_type="invalid_request_error",
        )


class Unauthenticated(GatewayError):
    """No valid API key: OpenAI's 401 (code ``invalid_api_key``), naming the scheme to use (RFC 6750)."""

    def __init__(self, message: str) -> None:
        super().__init__(401, message, code="invalid_api_key", headers={"www-authenticate": "Bearer"})


def from_rpc_error(exc: grpc.aio.AioRpcError) -> GatewayError:
    code = exc.code()
    status = HTTP_STATUS_FOR.get(code, 500)
    # Baton words its INVALID_ARGUMENT etc. messages for clients, so they are passed on as they are.
    message = exc.details() or code.name.lower()
    if code == grpc.StatusCode.UNAUTHENTICATED:  # the scheduler refused the forwarded key
        return Unauthenticated(message)
    return GatewayError(status, message, code=code.name.lower())
