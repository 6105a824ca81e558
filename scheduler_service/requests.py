"""The scheduler's request transfer objects, with JSON (never pickle) for what goes to Redis."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.lifecycle import FinishReason
from common.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A validated, tokenised request ready to enqueue."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    priority: int
    tenant: str
    deadline_ms: int
    arrival_ms: int
    ttft_target_ms: int = 0
    # Samples of the prompt the client asked for; ``samples.sample_requests`` makes them requests
    # of their own, each with n = 1 but sample 0, whose record keeps the count.
    n: int = 1


@dataclass(frozen=True)
class ClaimedRequest:
    """A request just moved QUEUED -> ASSIGNED: everything an executor needs to run or resume it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    params: SamplingParams
    score: float
    arrival_ms: int
    assigned_ms: int
    first_token_ms: int | None
    traceparent: str = ""  # the client call's trace context, for the executor's span
    tenant: str = "default"
    priority: int = 0
    preemptions: int = 0  # times it was preempted before: preemption spares it past the limit
    deadline_ms: int = 0
    expected_output: int = 0  # the estimator's output length at enqueue


@dataclass(frozen=True)
class TokenEvent:
    """One entry of a request's output stream."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason = FinishReason.NONE
    usage: dict[str, float] = field(default_factory=dict)

    def joined(self, later: TokenEvent) -> TokenEvent | None:
        """This event and ``later`` as one, when ``later`` starts where this one ends and this one
        is not final; else None."""
        if self.finish_reason is not FinishReason.NONE or self.index + len(self.token_ids) != later.index:
            return None
        return TokenEvent(
            self.index, self.token_ids + later.token_ids, self.text + later.text, later.finish_reason, later.usage
        )

    def to_fields(self) -> dict[str, str]:
        fields = {"i": str(self.index), "t": ",".join(map(str, self.token_ids)), "x": self.text}
        if self.finish_reason is not FinishReason.NONE:
            fields["f"] = str(int(self.finish_reason))
            fields["u"] = json.dumps(self.usage, separators=(",", ":"))
        return fields

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> TokenEvent:
        tokens = fields.get("t", "")
        return cls(
            index=int(fields["i"]),
            token_ids=tuple(int(t) for t in tokens.split(",")) if tokens else (),
            text=fields.get("x", ""),
            finish_reason=FinishReason(int(fields.get("f", "0"))),
            usage=json.loads(fields["u"]) if "u" in fields else {},
        )


def join_runs(events: Sequence[TokenEvent]) -> list[TokenEvent]:
    """``events`` with each run of contiguous ones joined into one (order kept)."""
    out: list[TokenEvent] = []
    for event in events:
        merged = out[-1].joined(event) if out else None
        if merged is None:
            out.append(event)
        else:
            out[-1] = merged
    return out


def parse_ids(raw: str | None) -> tuple[int, ...]:
    if not raw:
        return ()
    return tuple(int(t) for t in raw.split(","))
