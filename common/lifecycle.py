"""Request lifecycle states and finish reasons, shared by both services.

The numbers equal the protobuf enums in generate.proto, so conversion at the edges is an int cast.
"""

from __future__ import annotations

from enum import IntEnum


class FinishReason(IntEnum):
    NONE = 0
    STOP = 1
    LENGTH = 2
    CANCELLED = 3
    ERROR = 4


class RequestState(IntEnum):
    UNSPECIFIED = 0
    QUEUED = 1
    ASSIGNED = 2
    RUNNING = 3
    FINISHED = 4
    CANCELLED = 5
    FAILED = 6

    @property
    def is_terminal(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED)


def terminal_state_for(reason: FinishReason) -> RequestState:
    """The state a request ends in for a finish reason."""
    if reason is FinishReason.CANCELLED:
        return RequestState.CANCELLED
    if reason is FinishReason.ERROR:
        return RequestState.FAILED
    return RequestState.FINISHED
