"""Token batching: where a request's tokens are grouped into the chunks its client takes.

This is the one place Baton batches tokens. A client that asked for a stream interval of N tokens
(``SamplingParams.stream_interval_tokens``, or the server's ``distributed.stream_interval_tokens``)
gets its tokens N at a time; the scheduler sends that interval with the request's admission
(``AdmitRequest.stream_interval_tokens`` / ``stream_interval_ms``), and the executor holds the
request's tokens here until the chunk is complete. Batching where the tokens are made saves every
hop after it at once: the step report that carries them (a gRPC write here, about 0.7 ms of the
scheduler's CPU to receive and handle), the scheduler's Redis write (one recording script and one
stream entry per chunk, not per token), and the reader's wake-up. The scheduler writes what each
report carries as it comes and holds nothing back.

Per request, in a stream's step outputs:

- its first tokens on this stream go out at once, so time to first token does not move;
- then its tokens wait until N have gathered, or until the oldest has waited ``ms`` (when set);
- a finish, a preemption or a rejection sends everything it holds with that event, so the tokens
  it resumes from (after a hand-back) include them;
- prefix-cache events (names stored and evicted) of held steps are merged into the next report,
  so the scheduler's index of this executor's cache misses none;
- ``executor.report_every_steps`` E > 1 holds even a token-by-token request's tokens up to E steps
  or ``executor.report_max_wait_ms``, to save reports where clients take every token at once.

Reports follow windows of steps: a window ends after as many steps as the finest interval among
its requests (``every_steps`` for those that take every token), after ``report_max_wait_ms``, or
when a chunk passes its own time bound; its report carries every ready chunk, and a chunk short of
its interval waits for a later window (so a chunk holds at least its interval, a few tokens more
when requests joined out of step). A report also goes out at once when the scheduler must act on
the step: a finish, preemption or rejection, a plan acknowledged for the first time, prefill
still pending (the scheduler grants each chunk), a request's first tokens, or a step with no
tokens. With every interval 1 and E = 1 (the defaults) every step is a report, with no
bookkeeping on the step's path.

Tokens held here when the stream ends are dropped with the requests: their next driver re-queues
them from what Redis recorded, and they are generated again (exactly so for greedy and seeded
sampling). Clients never saw them, so nothing a client saw is contradicted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from executor_service.engine_io import NO_KV_EVENTS, KvCacheEvents, StepOutput, TokenOut


@dataclass(frozen=True)
class StreamInterval:
    """How a request's client takes its tokens: ``tokens`` at a time, or when the oldest is ``ms`` old."""

    tokens: int = 1  # 1: every token at once
    ms: int = 0  # 0: no time bound, only the count

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.ms < 0:
            raise ValueError(f"a stream interval needs tokens >= 1 and ms >= 0, got {self.tokens} and {self.ms}")


_EVERY_TOKEN = StreamInterval()


@dataclass
class _Held:
    """One request's tokens not yet reported, contiguous, and when the oldest was made."""

    tokens: TokenOut
    since: float


class TokenBatcher:
    """One Run stream's held tokens; ``offer`` each step's output, send the report it returns.

    ``offer`` runs on the engine thread (``ReportHub``); ``admitted`` and ``forget`` on the event
    loop's, before the plan they come from reaches the engine. They share only ``_intervals`` and
    ``_reported``, whose single dict and set operations are atomic.
    """

    def __init__(self, every_steps: int, max_wait_ms: float, clock: Callable[[], float] = time.monotonic) -> None:
        if every_steps < 1 or max_wait_ms < 0:
            raise ValueError(f"need every_steps >= 1 and max_wait_ms >= 0, got {every_steps} and {max_wait_ms}")
        self._every = every_steps
        self._max_wait_s = max_wait_ms / 1000.0
        self._clock = clock
        self._intervals: dict[str, StreamInterval] = {}  # requests whose client takes chunks
        self._held: dict[str, _Held] = {}
        self._held_num_tokens = 0  # tokens computed in steps not yet reported (a load figure)
        self._held_events: KvCacheEvents = NO_KV_EVENTS  # prefix-cache events of those steps
        self._steps_held = 0  # steps since the last report (or the last window that sent nothing)
        self._window_start = 0.0
        self._acked_seq = -1
        self._reported: set[str] = set()  # requests whose tokens this stream has carried

    def admitted(self, request_id: str, interval: StreamInterval) -> None:
        """A plan admitted ``request_id``, whose client takes its tokens at ``interval``."""
        if interval.tokens > 1:
            self._intervals[request_id] = interval
        else:
            self._intervals.pop(request_id, None)  # re-admitted with a finer interval
        self._reported.discard(request_id)  # a re-admission's first tokens go out at once

    def forget(self, request_id: str) -> None:
        """``request_id`` was aborted: what it holds goes with the next report, and nothing more waits."""
        self._intervals.pop(request_id, None)
        self._reported.discard(request_id)  # so what it holds is ready at once

    def offer(self, out: StepOutput) -> StepOutput | None:
        """The report to send now for this step (the ready chunks), or None while everything waits."""
        if self._every == 1 and not self._intervals and not self._held and not self._held_events:
            # The default: a report per step, with no bookkeeping on the step's path. What this
            # stream carried is forgotten, so if holding resumes (a chunked request is admitted)
            # every request's next tokens count as first ones: at worst one report more.
            self._reported.clear()
            self._acked_seq = out.plan_seq
            return out
        now = self._clock()
        if self._steps_held == 0:
            self._window_start = now
        self._steps_held += 1
        self._held_num_tokens += out.num_tokens
        if out.kv_events:
            self._held_events = self._held_events.then(out.kv_events)
        for t in out.tokens:
            held = self._held.get(t.request_id)
            if held is None or held.tokens.output_index + len(held.tokens.token_ids) != t.output_index:
                # Not the next tokens of what is held: the scheduler re-admitted the request from
                # what Redis recorded, and what its run before left here was never reported.
                self._held[t.request_id] = _Held(t, now)
            else:
                held.tokens = held.tokens.then(t)
        urgent = self._must_report(out)
        if not urgent and not self._window_over(out, now):
            return None
        # A window is over (or the scheduler must see this step): start the next one, and send
        # what is ready. A chunk still short of its interval waits for a later window.
        self._steps_held = 0
        ended = {f.request_id for f in (*out.finished, *out.rejected)} | set(out.preempted)
        ready = [rid for rid, held in self._held.items() if rid in ended or self._chunk_ready(rid, held, now)]
        if not ready and not urgent:
            return None
        tokens = tuple(self._held.pop(rid).tokens for rid in ready)
        report = replace(out, tokens=tokens, num_tokens=self._held_num_tokens, kv_events=self._held_events)
        self._held_num_tokens = 0
        self._held_events = NO_KV_EVENTS
        self._acked_seq = out.plan_seq
        self._reported.update(ready)
        for request_id in ended:
            self._reported.discard(request_id)
            self._intervals.pop(request_id, None)
        return report

    def _window_over(self, out: StepOutput, now: float) -> bool:
        """Whether the steps held since the last report should go now: as many as the finest
        interval among this step's requests (``every_steps`` for those that take every token),
        ``report_max_wait_ms`` since the first of them, or a chunk past its own time bound."""
        intervals, every = self._intervals, self._every
        steps = min((max(every, intervals[t.request_id].tokens) if t.request_id in intervals else every)
                    for t in out.tokens) if out.tokens else every  # fmt: skip
        if self._steps_held >= steps or now - self._window_start >= self._max_wait_s:
            return True
        return any(
            (interval := intervals.get(rid)) is not None and interval.ms and (now - held.since) * 1000 >= interval.ms
            for rid, held in self._held.items()
        )

    def _chunk_ready(self, request_id: str, held: _Held, now: float) -> bool:
        """Whether the request's client may take what it holds now: its first tokens (time to
        first token), a complete chunk, or a chunk that has waited the interval's ``ms``."""
        if request_id not in self._reported:
            return True
        interval = self._intervals.get(request_id, _EVERY_TOKEN)
        if interval.ms and (now - held.since) * 1000 >= interval.ms:
            return True
        return len(held.tokens.token_ids) >= interval.tokens

    def _must_report(self, out: StepOutput) -> bool:
        """Whether the scheduler must see this step now, whatever tokens wait."""
        if out.finished or out.preempted or out.rejected or not out.tokens:
            return True
        if out.plan_seq != self._acked_seq or out.pending_prefill_tokens > 0:
            return True
        return any(t.request_id not in self._reported for t in out.tokens)  # time to first token
