"""The stop_reason oneof, written and read the same way on every message that carries it."""

from __future__ import annotations

import pytest

from common.pb import executor_pb2, generate_pb2
from common.stop_reason import StopReason, read_stop_reason, write_stop_reason


@pytest.mark.parametrize("reason", ["\n\n", "42", 7, None])  # a string of digits stays a string
@pytest.mark.parametrize(
    "message", [executor_pb2.FinishedRequest, generate_pb2.GenerateResponse, generate_pb2.CompleteResponse]
)
def test_a_stop_reason_reads_back_as_written(message: type, reason: StopReason) -> None:
    msg = message()
    write_stop_reason(msg, reason)
    assert read_stop_reason(msg) == reason
