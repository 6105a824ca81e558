"""Transfer objects between the gRPC edge and the engine thread (protobuf stays at the edge)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from common.block_hashing import ROOT
from common.lifecycle import FinishReason
from common.logprobs import Logprobs, joined_logprobs
from common.sampling_params import SamplingParams


@dataclass(frozen=True)
class AdmitSpec:
    """A request joining the batch; sent once, named by id afterwards."""

    request_id: str
    prompt_ids: tuple[int, ...]
    # Tokens generated before a preemption or migration: re-prefilled, never re-sent to the client.
    output_ids: tuple[int, ...]
    params: SamplingParams
    rank: float
    # The name its first KV block chains from: ROOT, or its cache salt's (common/block_hashing.py).
    prefix_root: int = ROOT


@dataclass(frozen=True)
class PlanUpdate:
    """One plan's deltas. The engine applies every pending update at its next iteration boundary."""

    seq: int
    iteration: int = 0
    admit: tuple[AdmitSpec, ...] = ()
    abort: tuple[str, ...] = ()
    preempt: tuple[str, ...] = ()
    # Admits refused as they were read (parameters that do not hold): they end with their errors.
    refused: tuple[FinishOut, ...] = ()
    # Prefill tokens per request for the first step after this update (chunked prefill).
    grants: Mapping[str, int] = field(default_factory=dict)
    # The cached prefix each grant leaves out, as the scheduler expected it (PrefillGrant.expected_cached).
    expected_cached: Mapping[str, int] = field(default_factory=dict)
    # Standing tokens-per-step budget; 0 keeps the current one.
    token_budget: int = 0
    # Drop every running request (the stream that drove them ended); not a plan from a scheduler.
    abort_all: bool = False


class TokenOut(NamedTuple):
    """A request's new tokens from one step (or several, joined by ``then``).

    A typed NamedTuple rather than a frozen dataclass, though it is as immutable: one is built per token
    of every running request on the engine thread between steps, and a frozen dataclass's ``__init__``
    cost 0.65 µs against 0.25 (the whole of a token's postprocessing is about 2.5 µs).
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    output_index: int  # position in the output of the first token
    # Only for requests that asked: the tokens' log probabilities (one position per token), and
    # the prompt's, on the request's first output.
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    # On an admission's first output: the tokens it took from the prefix cache instead of computing.
    num_cached: int | None = None

    def then(self, later: TokenOut) -> TokenOut:
        """These tokens followed by ``later``'s (the next ones of the same request), as one output."""
        return TokenOut(
            self.request_id,
            self.token_ids + later.token_ids,
            self.text + later.text,
            self.output_index,
            joined_logprobs(self.logprobs, later.logprobs),
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            self.num_cached if self.num_cached is not None else later.num_cached,
        )


@dataclass(frozen=True)
class FinishOut:
    request_id: str
    reason: FinishReason
    # Held-back text not sent in a TokenOut yet (already trimmed at a stop string).
    text: str = ""
    error: str = ""
    # What stopped a STOP finish, as vLLM's stop_reason: the stop string, or a stop token other than
    # the tokenizer's end-of-sequence token; None otherwise.
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class KvCacheEvents:
    """What changed in the prefix cache's names (``common/block_hashing.py``) between two reports:
    the scheduler keeps an index of them per executor, to send a prompt where its prefix is."""

    # Forget every name reported before: ``stored`` lists every name held now.
    cleared: bool = False
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()  # disjoint from ``stored``

    def __bool__(self) -> bool:
        return self.cleared or bool(self.stored) or bool(self.removed)

    def then(self, later: KvCacheEvents) -> KvCacheEvents:
        """These events followed by ``later``, as one set (for a report that stands for both)."""
        if later.cleared or not self:
            return later
        if not later:
            return self
        later_stored, later_removed = set(later.stored), set(later.removed)
        stored = tuple(n for n in self.stored if n not in later_removed and n not in later_stored) + later.stored
        removed = tuple(n for n in self.removed if n not in later_stored and n not in later_removed)
        return KvCacheEvents(self.cleared, stored, removed + later.removed)


NO_KV_EVENTS = KvCacheEvents()


@dataclass(frozen=True)
class StepOutput:
    """What one iteration (or a plan applied while idle) produced."""

    iteration: int
    plan_seq: int
    tokens: tuple[TokenOut, ...]
    finished: tuple[FinishOut, ...]
    # Handed back to the scheduler (asked to, or out of KV blocks): it re-queues them.
    preempted: tuple[str, ...]
    # Refused at admission for now (batch full); the scheduler re-queues them.
    rejected: tuple[FinishOut, ...]
    num_tokens: int
    step_time_ns: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    pending_prefill_tokens: int
    # Prefix-cache names stored and evicted since the previous output.
    kv_events: KvCacheEvents = NO_KV_EVENTS
    # Since the engine started, in tokens: every admitted request's prompt and output so far
    # (queries), and those of them found cached, whose prefill was skipped (hits).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
