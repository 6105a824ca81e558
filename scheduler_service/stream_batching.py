"""Token-stream batching: fewer, larger Redis writes per request (vLLM's ``stream_interval``).

Every executor step brings each running request a token or a few. Unbatched, each one costs that
request a recording script and a stream entry (plus a reader's XREAD). With an interval of N
tokens, a request's tokens wait on the replica until N have gathered, or until the oldest has
waited T ms, and then go out as one write: one script call, one stream entry. What a client
receives is unchanged, only chunked more coarsely:

- a request's first event goes out at once, so time to first token does not move;
- its final event always carries everything still waiting;
- a request handed back (preempted, rejected, executor lost) has its waiting tokens written
  first, so the tokens it resumes from include them.

Tokens that wait here are not yet recorded in Redis. If this replica dies, they are lost with it;
the request is re-queued from what Redis recorded and those tokens are generated again (exactly so
for greedy and seeded sampling). Clients never saw them, so nothing a client saw is contradicted.
Time limits are checked when a step report arrives: every step while the executor has work, or,
where every request in a step asked for chunks (their interval is sent with each admission, unless
a time bound ``ms`` is set), at least every ``executor.report_max_wait_ms``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.lifecycle import FinishReason
from scheduler_service.requests import TokenEvent
from scheduler_service.store.step_publisher import StepWrite


@dataclass(frozen=True)
class StreamInterval:
    """When a request's waiting tokens are written: ``tokens`` of them, or the oldest ``ms`` old."""

    tokens: int = 1  # 1: every step's tokens go out at once (no batching)
    ms: int = 0  # 0: no time limit, only the token count

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.ms < 0:
            raise ValueError("a stream interval needs tokens >= 1 and ms >= 0")

    @property
    def batching(self) -> bool:
        return self.tokens > 1


@dataclass
class _Waiting:
    """One request's tokens not yet written, contiguous from ``start``."""

    start: int
    since: float  # monotonic seconds when the oldest arrived
    tokens: list[int] = field(default_factory=list)
    text: str = ""

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def write(self, request_id: str) -> StepWrite:
        return StepWrite(request_id, TokenEvent(self.start, tuple(self.tokens), self.text))


class StreamBatcher:
    """Holds back each request's step writes until its interval is reached; pure, no I/O.

    ``interval`` is the server's; a request may ask for a coarser one of its own (its
    ``stream_interval_tokens``, given to ``set_interval``), never a finer one.
    """

    def __init__(self, interval: StreamInterval) -> None:
        self.interval = interval
        self._waiting: dict[str, _Waiting] = {}
        self._started: set[str] = set()  # requests whose first event went out
        self._own: dict[str, StreamInterval] = {}  # requests with a coarser interval of their own

    def set_interval(self, request_id: str, tokens: int) -> None:
        """``request_id`` gathers ``tokens`` before a write, if that is more than the server's."""
        if tokens > self.interval.tokens:
            self._own[request_id] = StreamInterval(tokens, self.interval.ms)

    def executor_may_hold(self, request_id: str) -> int:
        """Steps ``request_id``'s executor may hold its tokens for: the tokens it gathers before a
        write, or 1 under a time bound (``ms``), which only this batcher can keep."""
        interval = self._own.get(request_id, self.interval)
        return interval.tokens if interval.ms == 0 else 1

    @property
    def batching(self) -> bool:
        """Some write may be held back: the server batches, or some request asked to."""
        return self.interval.batching or bool(self._own)

    def offer(self, write: StepWrite, now: float) -> list[StepWrite]:
        """The writes to make now for this step's ``write`` (possibly none, possibly a merged one)."""
        request_id, event = write.request_id, write.event
        final = event.finish_reason is not FinishReason.NONE
        interval = self._own.get(request_id, self.interval)
        if final:
            self._started.discard(request_id)
            self._own.pop(request_id, None)
        if not interval.batching:
            return [write]
        out: list[StepWrite] = []
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None and waiting.end != event.index:
            out.append(waiting.write(request_id))  # not contiguous: let Redis judge each on its own
            waiting = None
        if final:
            if waiting is not None:
                merged = TokenEvent(
                    waiting.start,
                    (*waiting.tokens, *event.token_ids),
                    waiting.text + event.text,
                    event.finish_reason,
                    event.usage,
                )
                write = StepWrite(request_id, merged, write.error)
            return [*out, write]
        if request_id not in self._started:
            self._started.add(request_id)  # the first event goes out at once: TTFT stays put
            return [*out, write]  # nothing can be waiting for a request not yet started
        if waiting is None:
            waiting = _Waiting(event.index, now)
        waiting.tokens.extend(event.token_ids)
        waiting.text += event.text
        if self._is_due(waiting, now, interval):
            out.append(waiting.write(request_id))
        else:
            self._waiting[request_id] = waiting
        return out

    def due(self, now: float) -> list[StepWrite]:
        """Writes whose oldest token has waited the interval's ``ms``, for requests without news this step."""
        ready = [
            rid
            for rid, waiting in self._waiting.items()
            if self._is_due(waiting, now, self._own.get(rid, self.interval))
        ]
        return [self._waiting.pop(rid).write(rid) for rid in ready]

    def take(self, request_id: str) -> StepWrite | None:
        """Everything ``request_id`` has waiting, now (it is being handed back); forget it."""
        self._started.discard(request_id)
        self._own.pop(request_id, None)
        waiting = self._waiting.pop(request_id, None)
        return None if waiting is None else waiting.write(request_id)

    @property
    def waiting_requests(self) -> int:
        return len(self._waiting)

    @staticmethod
    def _is_due(waiting: _Waiting, now: float, interval: StreamInterval) -> bool:
        if len(waiting.tokens) >= interval.tokens:
            return True
        return interval.ms > 0 and (now - waiting.since) * 1000 >= interval.ms


def coalesce(writes: list[StepWrite]) -> list[StepWrite]:
    """Merge each request's contiguous events (from several step reports) into one write.

    Order is kept (a request's merged write sits where its first one was); events that are not
    contiguous, or that follow a final event, stay separate so Redis judges each on its own.
    """
    out: list[StepWrite] = []
    last: dict[str, int] = {}  # request id -> its newest write's position in ``out``
    for write in writes:
        at = last.get(write.request_id)
        if at is not None:
            prev, event = out[at].event, write.event
            if prev.finish_reason is FinishReason.NONE and prev.index + len(prev.token_ids) == event.index:
                tokens, text = (*prev.token_ids, *event.token_ids), prev.text + event.text
                merged = TokenEvent(prev.index, tokens, text, event.finish_reason, event.usage)
                out[at] = StepWrite(write.request_id, merged, write.error)
                continue
        last[write.request_id] = len(out)
        out.append(write)
    return out
