"""common.lifecycle: the enums equal the protobuf enums number for number, and terminal states."""

from __future__ import annotations

import pytest

from common.lifecycle import FinishReason, RequestState, terminal_state_for
from common.pb import generate_pb2 as pb


def test_finish_reason_matches_the_protobuf_enum_both_ways() -> None:
    proto = pb.FinishReason
    expected = {name.removeprefix("FINISH_REASON_"): number for name, number in proto.items()}
    assert {member.name: member.value for member in FinishReason} == expected
    for member in FinishReason:
        assert proto.Name(int(member)) == f"FINISH_REASON_{member.name}"


def test_request_state_matches_the_protobuf_enum_both_ways() -> None:
    proto = pb.RequestState
    expected = {name.removeprefix("REQUEST_STATE_"): number for name, number in proto.items()}
    assert {member.name: member.value for member in RequestState} == expected
    for member in RequestState:
        assert proto.Name(int(member)) == f"REQUEST_STATE_{member.name}"


@pytest.mark.parametrize(
    ("proto_value", "member"),
    [
        (pb.FINISH_REASON_NONE, FinishReason.NONE),
        (pb.FINISH_REASON_STOP, FinishReason.STOP),
        (pb.FINISH_REASON_LENGTH, FinishReason.LENGTH),
        (pb.FINISH_REASON_CANCELLED, FinishReason.CANCELLED),
        (pb.FINISH_REASON_ERROR, FinishReason.ERROR),
    ],
)
def test_finish_reason_converts_to_and_from_protobuf_by_int_cast(proto_value: int, member: FinishReason) -> None:
    assert FinishReason(proto_value) is member
    assert int(member) == proto_value


@pytest.mark.parametrize(
    ("proto_value", "member"),
    [
        (pb.REQUEST_STATE_UNSPECIFIED, RequestState.UNSPECIFIED),
        (pb.REQUEST_STATE_QUEUED, RequestState.QUEUED),
        (pb.REQUEST_STATE_ASSIGNED, RequestState.ASSIGNED),
        (pb.REQUEST_STATE_RUNNING, RequestState.RUNNING),
        (pb.REQUEST_STATE_FINISHED, RequestState.FINISHED),
        (pb.REQUEST_STATE_CANCELLED, RequestState.CANCELLED),
        (pb.REQUEST_STATE_FAILED, RequestState.FAILED),
    ],
)
def test_request_state_converts_to_and_from_protobuf_by_int_cast(proto_value: int, member: RequestState) -> None:
    assert RequestState(proto_value) is member
    assert int(member) == proto_value


def test_enum_values_fit_protobuf_messages() -> None:
    response = pb.CancelResponse(state=int(RequestState.CANCELLED))  # type: ignore[arg-type]
    assert response.state == pb.REQUEST_STATE_CANCELLED
    chunk = pb.GenerateResponse(finish_reason=int(FinishReason.LENGTH))  # type: ignore[arg-type]
    assert FinishReason(chunk.finish_reason) is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("reason", "state"),
    [
        (FinishReason.STOP, RequestState.FINISHED),
        (FinishReason.LENGTH, RequestState.FINISHED),
        (FinishReason.CANCELLED, RequestState.CANCELLED),
        (FinishReason.ERROR, RequestState.FAILED),
    ],
)
def test_terminal_state_for_each_finish_reason(reason: FinishReason, state: RequestState) -> None:
    assert terminal_state_for(reason) is state
    assert terminal_state_for(reason).is_terminal


def test_only_finished_cancelled_and_failed_are_terminal() -> None:
    terminal = {s for s in RequestState if s.is_terminal}
    assert terminal == {RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED}
