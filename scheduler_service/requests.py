"""The scheduler's request transfer objects, with JSON (never pickle) for what goes to Redis."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.block_hashing import ROOT
from common.lifecycle import FinishReason
from common.logprobs import Logprobs, joined_logprobs
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
    # What salts its prefix cache: its own cache_salt, with its tenant where each tenant has a
    # cache of its own; the record keeps only the root it names (common/block_hashing.py).
    cache_salt: str = ""
    # Its max_tokens is the context's room (``SamplingParams.fill_context``), not a length the
    # client expects: scoring predicts its output as a default request's.
    open_ended: bool = False


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
    cached_prompt_tokens: int | None = None  # recorded with its first token (the usage's cached tokens)
    prefix_root: int = ROOT  # the name its first KV block chains from (its cache salt's, or ROOT)


@dataclass(frozen=True)
class TokenEvent:
    """One entry of a request's output stream."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason = FinishReason.NONE
    usage: dict[str, float] = field(default_factory=dict)
    # Only for requests that asked (fields "l" and "p", packed; absent otherwise): the tokens'
    # log probabilities, one position per token, and the prompt's, on the event at index 0.
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    # A STOP finish's stop string ("s") or stop token ("k"), vLLM's stop_reason; absent otherwise.
    stop_reason: str | int | None = None

    def joined(self, later: TokenEvent) -> TokenEvent | None:
        """This event and ``later`` as one, when ``later`` starts where this one ends and this one
        is not final; else None."""
        if self.finish_reason is not FinishReason.NONE or self.index + len(self.token_ids) != later.index:
            return None
        if self.token_ids and later.token_ids and (self.logprobs is None) != (later.logprobs is None):
            return None  # one side's tokens lost their logprobs (a repaired gap): keep positions aligned
        return self.then(later)

    def to_fields(self) -> dict[str, str]:
        fields = {"i": str(self.index), "t": ",".join(map(str, self.token_ids)), "x": self.text}
        if self.finish_reason is not FinishReason.NONE:
            fields["f"] = str(int(self.finish_reason))
            fields["u"] = json.dumps(self.usage, separators=(",", ":"))
        if self.logprobs is not None:
            fields["l"] = self.logprobs.pack()
        if self.prompt_logprobs is not None:
            fields["p"] = self.prompt_logprobs.pack()
        if isinstance(self.stop_reason, str):
            fields["s"] = self.stop_reason
        elif self.stop_reason is not None:
            fields["k"] = str(self.stop_reason)
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
            logprobs=Logprobs.unpack(fields["l"]) if "l" in fields else None,
            prompt_logprobs=Logprobs.unpack(fields["p"]) if "p" in fields else None,
            stop_reason=fields["s"] if "s" in fields else int(fields["k"]) if "k" in fields else None,
        )

    def after(self, skip: int) -> TokenEvent:
        """This event without its first ``skip`` tokens (a client already has them): their text and
        log probabilities go too, and the prompt's, which came with the first token."""
        if skip <= 0:
            return self
        return TokenEvent(
            self.index + skip,
            self.token_ids[skip:],
            "",
            self.finish_reason,
            self.usage,
            self.logprobs.slice(skip) if self.logprobs is not None else None,
            stop_reason=self.stop_reason,
        )

    def then(self, later: TokenEvent) -> TokenEvent:
        """This event followed by ``later`` (the next tokens of the same request), as one event."""
        return TokenEvent(
            self.index,
            self.token_ids + later.token_ids,
            self.text + later.text,
            later.finish_reason,
            later.usage,
            joined_logprobs(self.logprobs, later.logprobs),
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            later.stop_reason,
        )


def usage_of(
    prompt_tokens: int,
    completion_tokens: int,
    arrival_ms: int,
    assigned_ms: int,
    first_token_ms: int | None,
    cached_tokens: int = 0,
) -> dict[str, float]:
    """A final event's usage (a request never assigned has ``assigned_ms`` 0: no queue time, no
    time to first token)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "queue_time_ms": float(max(0, assigned_ms - arrival_ms)),
        "ttft_ms": float(max(0, (first_token_ms or assigned_ms) - arrival_ms)),
        "cached_tokens": cached_tokens,
    }


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
