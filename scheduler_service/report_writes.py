"""Turning one executor's step reports into Redis writes, and into the metrics they carry.

Each request in a report becomes one ``StepWrite``; a finishing request's last tokens ride on its
final event, with its usage. The executor says where its tokens sit in the output, and Redis
refuses them unless that is exactly the next position, so a stale computation never slips in.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from common.clock import now_ms
from common.lifecycle import FinishReason
from common.logprobs import Logprobs
from common.pb import executor_pb2 as pb
from common.stop_reason import read_stop_reason
from scheduler_service.linked_requests import LinkedRequest
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.requests import TokenEvent, usage_of
from scheduler_service.store.step_publisher import StepWrite

log = logging.getLogger(__name__)


class ReportWrites:
    """One link's translator: it updates the link's request table as reports come in."""

    def __init__(self, executor_id: str, requests: dict[str, LinkedRequest], metrics: SchedulerMetrics) -> None:
        self._executor_id = executor_id
        self._requests = requests  # the link's own table: finished requests leave it here
        self._metrics = metrics
        self._last_token_at: dict[str, float] = {}

    def forget(self, request_id: str) -> None:
        """``request_id`` left the link another way (handed back, refused): drop its timing."""
        self._last_token_at.pop(request_id, None)

    def of(self, report: pb.StepReport) -> list[StepWrite]:
        """The report's writes, one per request it names (finished ones leave the table)."""
        finished = {f.request_id: f for f in report.finished}
        stamp = now_ms()
        now = time.monotonic()
        writes: list[StepWrite] = []
        generated = 0
        for delta in report.tokens:
            req = self._requests.get(delta.request_id)
            if req is None:
                continue  # aborted or handed back meanwhile
            if req.first_token_ms is None:  # its first token ever (a resumed request's is in its record)
                req.first_token_ms = stamp
                self._metrics.ttft.observe(max(0, stamp - req.arrival_ms) / 1000)
            cached = None
            if delta.HasField("cached_tokens"):  # the admission's first delta
                if req.cached_prompt_tokens is None:  # the first admission that produced a token decides
                    req.cached_prompt_tokens = min(delta.cached_tokens, req.prompt_len)
                cached = req.cached_prompt_tokens
            fin = finished.pop(delta.request_id, None)
            tokens = tuple(delta.token_ids)
            generated += len(tokens)
            self._observe_tokens(req.request_id, now, len(tokens))
            req.generated = delta.index
            event = TokenEvent(delta.index, tokens, delta.text, logprobs=_logprobs(delta, "logprobs"))
            if delta.HasField("prompt_logprobs"):
                event = replace(event, prompt_logprobs=_logprobs(delta, "prompt_logprobs"))
            if fin is None:
                writes.append(StepWrite(req.request_id, event, cached_tokens=cached))
            else:
                writes.append(replace(self._final_write(req, event, fin), cached_tokens=cached))
            req.generated = delta.index + len(tokens)
        for fin in finished.values():
            req = self._requests.get(fin.request_id)
            if req is not None:
                writes.append(self._final_write(req, TokenEvent(req.generated, (), ""), fin))
        if generated:
            self._metrics.generation_tokens.inc(generated)  # once per step, not per request
        return writes

    def _observe_tokens(self, request_id: str, now: float, count: int) -> None:
        """One inter-token gap per token: a chunk of ``count`` (a client's stream interval, reports
        held for several steps) shares the time since the last one."""
        last = self._last_token_at.get(request_id)
        if last is not None and count:
            gap = (now - last) / count
            for _ in range(count):
                self._metrics.itl.observe(gap)
        self._last_token_at[request_id] = now

    def _final_write(self, req: LinkedRequest, event: TokenEvent, fin: pb.FinishedRequest) -> StepWrite:
        """``event`` (the step's last tokens, if any) as the request's final one."""
        del self._requests[req.request_id]
        self.forget(req.request_id)
        if fin.error:
            log.warning("request %s failed on %s: %s", req.request_id, self._executor_id, fin.error)
        usage = usage_of(
            req.prompt_len,
            req.generated + len(event.token_ids),
            req.arrival_ms,
            req.assigned_ms,
            req.first_token_ms,
            req.cached_prompt_tokens or 0,
        )
        reason = FinishReason(fin.finish_reason)
        if req.deadline_ms:
            self._metrics.deadlines.labels("met" if now_ms() <= req.deadline_ms else "missed").inc()
        self._metrics.observe_finish(reason, usage, (now_ms() - req.arrival_ms) / 1000)
        stop = read_stop_reason(fin)
        final = replace(event, text=event.text + fin.text, finish_reason=reason, usage=usage, stop_reason=stop)
        return StepWrite(req.request_id, final, fin.error)


def _logprobs(delta: pb.TokenDelta, name: str) -> Logprobs | None:
    """The delta's ``logprobs`` or ``prompt_logprobs``, when the executor set them (requests that asked)."""
    return Logprobs.from_pb(getattr(delta, name)) if delta.HasField(name) else None


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
            earlier = out[at]
            merged = earlier.event.joined(write.event)
            if merged is not None:
                cached = earlier.cached_tokens if earlier.cached_tokens is not None else write.cached_tokens
                out[at] = StepWrite(write.request_id, merged, write.error, cached)
                continue
        last[write.request_id] = len(out)
        out.append(write)
    return out
