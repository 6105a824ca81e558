"""Domain errors. One interceptor (common.grpc_errors) maps each to a gRPC status code."""

from __future__ import annotations


class BatonError(Exception):
    """Base of every error Baton reports to a client on purpose."""


class InvalidRequest(BatonError, ValueError):
    """The client's input is wrong: INVALID_ARGUMENT."""


class NotFound(BatonError):
    """The named request or object does not exist: NOT_FOUND."""


class AlreadyExists(BatonError):
    """A request with this id was already accepted: ALREADY_EXISTS."""


class Overloaded(BatonError):
    """Backpressure: the queue is full: RESOURCE_EXHAUSTED, with a hint of when to retry."""

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class NotReady(BatonError):
    """A dependency (Redis, executors) is unavailable right now: UNAVAILABLE."""


class FailedPrecondition(BatonError):
    """The request is well formed but the served model cannot honour it (a conversation for a model
    without a chat template): FAILED_PRECONDITION."""


class DeadlineExceeded(BatonError):
    """The request's deadline passed: DEADLINE_EXCEEDED."""


class PermissionDenied(BatonError):
    """The caller's tenant may not touch this request: PERMISSION_DENIED."""


class DataLoss(BatonError):
    """A request's state in Redis is corrupt and cannot be served: DATA_LOSS."""
