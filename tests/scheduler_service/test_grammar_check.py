"""The scheduler's structured-output checks: the request's limits (validation) and the grammar
check, which parses off the event loop and remembers its verdicts."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequest
from common.pb import generate_pb2 as pb
from common.structured_output import StructuredKind, StructuredOutput
from scheduler_service.grammar_check import GrammarCheck
from scheduler_service.validation import MAX_STRUCTURED_OUTPUT_CHARS
from tests.scheduler_service.test_validation import make, run

SCHEMA = StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type":"object","properties":{"a":{"type":"string"}}}')
BAD_REGEX = StructuredOutput(StructuredKind.REGEX, "[a-")


def test_validation_carries_the_constraint() -> None:
    msg = make()
    msg.params.structured_output.CopyFrom(SCHEMA.to_pb())
    assert run(msg).params.structured_output == SCHEMA
    assert run(make()).params.structured_output is None


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (pb.StructuredOutput(regex="a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)), "characters of specification"),
        (pb.StructuredOutput(choice=pb.StructuredChoice(choices=["x" * 40000, "y" * 40000])), "at most 65536"),
        (pb.StructuredOutput(choice=pb.StructuredChoice()), "at least one choice"),
        (pb.StructuredOutput(json_schema=""), "non-empty specification"),
        (pb.StructuredOutput(json_object=False), "must be true"),
    ],
)
def test_validation_refuses_oversized_or_empty_constraints(constraint: pb.StructuredOutput, message: str) -> None:
    msg = make()
    msg.params.structured_output.CopyFrom(constraint)
    with pytest.raises(InvalidRequest, match=message):
        run(msg)


async def test_check_accepts_valid_and_refuses_invalid_constraints() -> None:
    check = GrammarCheck()
    await check.check(SCHEMA)
    with pytest.raises(InvalidRequest, match="structured_output regex: "):
        await check.check(BAD_REGEX)


async def test_verdicts_are_remembered_most_recent_last_within_capacity() -> None:
    check = GrammarCheck(capacity=2)
    other = StructuredOutput(StructuredKind.CHOICE, choices=("a", "b"))
    await check.check(SCHEMA)
    with pytest.raises(InvalidRequest):
        await check.check(BAD_REGEX)
    with pytest.raises(InvalidRequest):  # from memory, the same answer
        await check.check(BAD_REGEX)
    await check.check(SCHEMA)  # SCHEMA is now the most recently used
    await check.check(other)  # evicts BAD_REGEX
    assert len(check) == 2
    assert list(check._verdicts) == [SCHEMA, other]
