"""Request records in Redis (a hash and a token list per request, the queues they sit in): every
state move is one of the Lua scripts in ``request_scripts.py``. Queue reads: ``queue.py``; a step's
writes: ``step_publisher.py``."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError
from redis.typing import EncodableT, KeyT

from common.block_hashing import ROOT
from common.clock import now_ms
from common.errors import AlreadyExists, Overloaded
from common.keys import KeySchema
from common.lifecycle import FinishReason, RequestState, terminal_state_for
from common.sampling_params import SamplingParams
from scheduler_service.requests import ClaimedRequest, NewRequest, TokenEvent, parse_ids, usage_of
from scheduler_service.samples import ALONE_FIELD, SAMPLES_FIELD
from scheduler_service.store import request_scripts
from scheduler_service.store.script_batcher import ScriptBatcher
from scheduler_service.store.token_streams import TokenStreams

log = logging.getLogger(__name__)

# What reading a malformed request's fields raises: a missing field, text where a number belongs,
# broken JSON, a params object with unknown keys.
MALFORMED_FIELDS = (KeyError, ValueError, TypeError, IndexError, json.JSONDecodeError)

# Hand-back kinds for a request that leaves its executor other than by preemption: lost to a failure
# (counted against ``max_migrations``), or moved by a planned stop of its executor or of the replica
# driving it (counted as neither: a rolling update must not use up the budget meant for failures).
MIGRATE = "migrate"
HANDOVER = "handover"


@dataclass(frozen=True)
class CancelOutcome:
    state: RequestState | None  # None: no such request
    executor_id: str
    tokens: int
    ended_here: bool  # it was queued, and this cancel ended it


class RequestRecords:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: KeySchema,
        streams: TokenStreams,
        request_ttl_s: int,
        max_migrations: int = 3,
        estimator_alpha: float = 0.2,
    ) -> None:
        self._redis = redis
        self.keys = keys
        self.ttl_s = request_ttl_s
        self.max_migrations = max_migrations
        self.estimator_alpha = estimator_alpha
        self._streams = streams  # a request ended here gets its final event there
        # Submits that arrive together (a batch stream's) share round trips too.
        self._enqueue = ScriptBatcher(redis, redis.register_script(request_scripts.ENQUEUE))
        self._claim = redis.register_script(request_scripts.CLAIM)
        self._append = redis.register_script(request_scripts.APPEND_TOKENS)
        self._finish = redis.register_script(request_scripts.FINISH)
        self._requeue = redis.register_script(request_scripts.REQUEUE)
        self._cancel = redis.register_script(request_scripts.CANCEL)
        self._quarantine = redis.register_script(request_scripts.QUARANTINE)
        self.on_quarantine: Callable[[], None] = lambda: None  # counts malformed requests (a metric)
        # Counts requests ended here, outside an executor's report (a metric): a cancel while
        # queued, an end no executor can give, the migration limit, an unreadable record.
        self.on_end: Callable[[FinishReason], None] = lambda reason: None

    async def enqueue(
        self,
        req: NewRequest,
        score: float,
        max_pending: int,
        traceparent: str = "",
        scheduling: Mapping[str, str] | None = None,
    ) -> None:
        """Queue ``req``; refused (``Overloaded``) once ``max_pending`` requests wait.

        ``scheduling`` adds the fairness and estimator fields (``fair_cost``, ``est_out``, ...).
        """
        await self.enqueue_samples([req], score, max_pending, traceparent, scheduling)

    async def enqueue_samples(
        self,
        samples: Sequence[NewRequest],
        score: float,
        max_pending: int,
        traceparent: str = "",
        scheduling: Mapping[str, str] | None = None,
        submission: str = "",
        stamp_tenant: bool = True,
    ) -> None:
        """Queue the samples of one request (``scheduler_service.samples``) in one script: all or
        none. Sample 0's record keeps their count; each counts against ``max_pending``.
        ``submission`` names the client's call (random when not given): a retry of this call with
        the same one, after its first attempt landed and its reply was lost, succeeds.
        ``stamp_tenant`` marks the tenant seen now, for forgetting idle tenants (off where that
        is off: the stamps would only grow)."""
        first = samples[0]
        keys = [
            self.keys.pending,
            self.keys.tenants_waiting,
            self.keys.tenant_counters,
            self.keys.tenant_vclock,
            self.keys.tenants_seen,
        ]
        # Tells this call's own record from another's, should it be sent twice.
        submission = submission or secrets.token_hex(8)
        stamp = now_ms() if stamp_tenant else ""
        args: list[EncodableT] = [max_pending, self.keys.tenant_queue_prefix, first.tenant, stamp, submission]
        for req in samples:
            fields = {
                "state": RequestState.QUEUED.name,
                "prompt_ids": ",".join(map(str, req.prompt_ids)),
                "prompt_len": str(len(req.prompt_ids)),
                "params": req.params.to_json(),
                "priority": str(req.priority),
                "deadline_ms": str(req.deadline_ms),
                "arrival_ms": str(req.arrival_ms),
                "score": repr(score),
                "executor": "",
                "traceparent": traceparent,
                **(scheduling or {}),
            }
            if req is first:
                fields["submission"] = submission
            if req.n > 1:
                fields[SAMPLES_FIELD] = str(req.n)
            if req is not first and req.params.prompt_logprobs is not None:
                # Scoring its prompt, it computes the whole prompt itself (no prefix cache): it has
                # nothing to wait for from sample 0, nor a reason to follow it.
                fields[ALONE_FIELD] = "1"
            keys.append(self.keys.request(req.request_id))
            args += [req.request_id, repr(score), 2 * len(fields), *(item for pair in fields.items() for item in pair)]
        result = await self._enqueue(keys, args)
        if result == -1:
            raise AlreadyExists(f"request_id {first.request_id!r} was already submitted")
        if result == -2:
            raise Overloaded(f"the queue is full ({max_pending} pending requests); retry later")

    async def claim(self, request_id: str, executor_id: str, owner: str | None = None) -> ClaimedRequest | None:
        """QUEUED -> ASSIGNED on ``executor_id``; ``owner`` (default: the executor id) fences later writes."""
        (claimed,) = await self.claim_many([(request_id, executor_id, owner or executor_id)])
        return claimed

    async def claim_many(
        self, claims: Sequence[tuple[str, str, str]], caps: Mapping[str, int] | None = None
    ) -> list[ClaimedRequest | None]:
        """``claim`` for each (request id, executor id, owner), in one pipeline: one round trip
        for a whole admission round instead of one per request. Each claim is still its own
        script, judged on its own (None: no longer queued, or its tenant is at its running cap in
        ``caps``)."""
        calls: list[tuple[list[KeyT], list[EncodableT]]] = []
        caps_json = json.dumps(dict(caps or {}))
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id, executor_id, owner in claims:
                keys: list[KeyT] = [
                    self.keys.pending,
                    self.keys.request(request_id),
                    self.keys.running(executor_id),
                    self.keys.tokens(request_id),
                    self.keys.tenants_waiting,
                    self.keys.tenant_counters,
                    self.keys.tenant_vclock,
                    self.keys.tenant_running,
                ]
                args: list[EncodableT] = [
                    request_id,
                    executor_id,
                    now_ms(),
                    owner,
                    self.keys.tenant_queue_prefix,
                    caps_json,
                ]
                calls.append((keys, args))
                await self._claim(keys=keys, args=args, client=pipe)
            rows = await pipe.execute(raise_on_error=False)
        out: list[ClaimedRequest | None] = []
        for (request_id, executor_id, _), (keys, args), row in zip(claims, calls, rows, strict=True):
            claimed = None
            if isinstance(row, NoScriptError):
                # Redis restarted between the pipeline's script check and its retried send: the
                # claim never ran. Run alone, it loads the script again (an error now is Redis's,
                # and the round settles the claims next time).
                row = await self._claim(keys=keys, args=args)
            try:
                if isinstance(row, Exception) or row == request_scripts.MALFORMED:
                    raise ValueError(f"its claim failed: {row}")
                claimed = _claimed(request_id, row)
            except MALFORMED_FIELDS as e:
                await self.quarantine(request_id, f"its record in Redis is malformed ({e})", executor_id)
            out.append(claimed)
        return out

    async def append_tokens(
        self, pipe: aioredis.client.Pipeline, request_id: str, owner: str, event: TokenEvent
    ) -> None:
        """Queue on ``pipe``: record the tokens on the request, if ``owner`` still holds it."""
        keys = [self.keys.request(request_id), self.keys.tokens(request_id)]
        args: list[EncodableT] = [owner, event.index, now_ms(), *event.token_ids]
        await self._append(keys=keys, args=args, client=pipe)

    async def finish(
        self,
        pipe: aioredis.client.Pipeline,
        request_id: str,
        executor_id: str,
        reason: FinishReason,
        error: str = "",
        owner: str | None = None,
        only_if: str = "",
    ) -> None:
        """Queue on ``pipe``: move to the terminal state for ``reason`` and start the records' TTL.

        ``owner`` (default: the executor id; "" for anyone) must hold the request; ``only_if``, a
        state it must be in ("" for any active one).
        """
        keys = [
            self.keys.request(request_id),
            self.keys.running(executor_id),
            self.keys.tokens(request_id),
            self.keys.pending,
            self.keys.tenants_waiting,
            self.keys.tenant_counters,
            self.keys.tenant_running,
            self.keys.estimator,
        ]
        state = terminal_state_for(reason)
        holder = executor_id if owner is None else owner
        args: list[EncodableT] = [
            request_id,
            holder,
            state.name,
            reason.name,
            now_ms(),
            self.ttl_s,
            error,
            self.keys.tenant_queue_prefix,
            self.estimator_alpha,
            only_if,
        ]
        await self._finish(keys=keys, args=args, client=pipe)

    async def finish_now(
        self, request_id: str, executor_id: str, event: TokenEvent, error: str = "", only_if: str = ""
    ) -> bool:
        """End a request outside a step (one no executor can hold, a lost executor); publish if it
        ended here. ``only_if``: the state it must still be in."""
        async with self._redis.pipeline(transaction=False) as pipe:
            await self.finish(pipe, request_id, executor_id, event.finish_reason, error, only_if=only_if)
            (result,) = await pipe.execute()
        if int(result) == request_scripts.MALFORMED:
            return await self.quarantine(request_id, "its record in Redis is malformed", executor_id)
        if int(result) != 1:
            return False
        self.on_end(event.finish_reason)
        await self._streams.publish_final(request_id, event)
        return True

    async def requeue(self, request_id: str, executor_id: str, kind: str = "preempt", owner: str | None = None) -> int:
        """Back to QUEUED with its tokens kept; see request_scripts.REQUEUE for the result codes."""
        keys = [
            self.keys.request(request_id),
            self.keys.running(executor_id),
            self.keys.pending,
            self.keys.tenants_waiting,
            self.keys.tenant_counters,
            self.keys.tenant_vclock,
            self.keys.tenant_running,
            self.keys.tokens(request_id),
            self.keys.estimator,
        ]
        holder = executor_id if owner is None else owner
        args: list[EncodableT] = [
            request_id,
            holder,
            now_ms(),
            kind,
            self.max_migrations,
            self.keys.tenant_queue_prefix,
            executor_id,
            self.ttl_s,
            self.estimator_alpha,
            f"its executor was lost more than {self.max_migrations} times",
        ]
        return int(await self._requeue(keys=keys, args=args))

    async def hand_back(
        self, request_id: str, executor_id: str, kind: str = "preempt", owner: str | None = None
    ) -> None:
        """Re-queue a request its executor gave up (``preempt``) or lost (``migrate``), or one a
        planned stop moves (``handover``), or whose claim no executor was told of (``unclaim``), or
        whose end Redis lost (``orphan``); the last three count as neither.

        A pending cancel ends it as CANCELLED instead, and a request past the migration limit
        ends as FAILED (a request that keeps killing executors must not take the fleet down), in
        the same script; its final event is published after.
        """
        self._streams.release_local(request_id)  # first, so a Redis error below cannot leave it unfollowed
        result = await self.requeue(request_id, executor_id, kind, owner)
        if result == request_scripts.MALFORMED:
            await self.quarantine(request_id, "its record in Redis is malformed", executor_id)
            return
        if result not in (2, 3):
            return
        reason = FinishReason.CANCELLED if result == 2 else FinishReason.ERROR
        self.on_end(reason)
        await self._streams.publish_final(request_id, await self.final_event(request_id, reason))

    async def cancel(self, request_id: str) -> CancelOutcome:
        keys = [
            self.keys.request(request_id),
            self.keys.pending,
            self.keys.tokens(request_id),
            self.keys.tenants_waiting,
            self.keys.tenant_counters,
        ]
        args: list[EncodableT] = [request_id, now_ms(), self.ttl_s, self.keys.tenant_queue_prefix]
        state, executor_id, tokens, ended = await self._cancel(keys=keys, args=args)
        if state == "MISSING":
            return CancelOutcome(None, "", 0, False)
        if state == "MALFORMED":
            ended_here = await self.quarantine(request_id, "its record in Redis is malformed")
            return CancelOutcome(RequestState.FAILED, "", 0, ended_here)
        if ended == "1":
            self.on_end(FinishReason.CANCELLED)
        return CancelOutcome(RequestState[state], executor_id, int(tokens), ended == "1")

    async def quarantine(self, request_id: str, error: str, executor_id: str = "", tenant: str = "") -> bool:
        """End a request whose Redis state cannot be read or moved: FAILED with ``error``, out of
        every queue, its stream closed with an error event (a stream key of another type is
        replaced). The rest of the fleet's work goes on untouched. Returns whether it ended here.

        ``executor_id`` and ``tenant`` say where it may sit when its record is unreadable."""
        keys = [
            self.keys.request(request_id),
            self.keys.tokens(request_id),
            self.keys.pending,
            self.keys.tenants_waiting,
            self.keys.tenant_running,
        ]
        if executor_id:
            keys.append(self.keys.running(executor_id))
        args: list[EncodableT] = [request_id, tenant, self.keys.tenant_queue_prefix, now_ms(), self.ttl_s, error]
        if int(await self._quarantine(keys=keys, args=args)) != 1:
            return False  # it had ended: a malformed stream of it stays, and its readers say so
        log.error("request %s failed: %s", request_id, error)
        self.on_quarantine()
        self.on_end(FinishReason.ERROR)
        if await self._streams.is_malformed(request_id):
            await self._streams.drop(request_id)
        tokens = await self.token_count(request_id)
        await self._streams.publish_final(request_id, TokenEvent(tokens, (), "", FinishReason.ERROR, {}))
        return True

    async def get(self, request_id: str) -> dict[str, str] | None:
        record = cast(dict[str, str], await self._redis.hgetall(self.keys.request(request_id)))
        if not record:
            return None
        record["tokens_generated"] = str(await self._redis.llen(self.keys.tokens(request_id)))
        return record

    async def final_event(self, request_id: str, reason: FinishReason) -> TokenEvent:
        """The final event of a request that ended outside an executor's report (cancelled while
        queued, past the migration limit, fitting no executor): at its recorded token count, with
        the usage its record gives, as a final event from its executor has it."""
        fields = ("prompt_len", "arrival_ms", "assigned_ms", "first_token_ms", "cached_tokens")
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self.keys.request(request_id), fields)
            pipe.llen(self.keys.tokens(request_id))
            record, tokens = await pipe.execute()
        prompt, arrival, assigned, first, cached = (int(v) if v and v.isdigit() else 0 for v in record)
        return TokenEvent(
            int(tokens), (), "", reason, usage_of(prompt, int(tokens), arrival, assigned, first or None, cached)
        )

    async def exist(self, request_ids: Sequence[str]) -> list[bool]:
        """Whether each request has a record, in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.exists(self.keys.request(request_id))
            return [bool(found) for found in await pipe.execute()]

    async def token_count(self, request_id: str) -> int:
        """How many output tokens the request has recorded."""
        return int(await self._redis.llen(self.keys.tokens(request_id)))

    async def tokens_between(self, request_id: str, start: int, end: int) -> tuple[int, ...]:
        """Recorded output tokens ``start..end-1``: the source of truth a reader repairs gaps from."""
        raw = await self._redis.lrange(self.keys.tokens(request_id), start, end - 1)  # type: ignore[misc]
        return tuple(int(t) for t in raw)

    async def running_ids(self, executor_id: str) -> set[str]:
        return set(cast(set[str], await self._redis.smembers(self.keys.running(executor_id))))

    async def owners(self, request_ids: Sequence[str]) -> list[str | None]:
        """Each request's owner fence (the link its claim named); None for a missing record."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hget(self.keys.request(request_id), "owner")
            return cast(list[str | None], await pipe.execute())


def _claimed(request_id: str, row: list[str] | None) -> ClaimedRequest | None:
    if not row:
        return None
    prompt, params, score, arrival, assigned, first_token, _, out, traceparent, *rest = row
    tenant, priority, preemptions, deadline, est_out, cached, root = rest
    return ClaimedRequest(
        request_id=request_id,
        prompt_ids=parse_ids(prompt),
        output_ids=parse_ids(out),
        params=SamplingParams.from_json(params),
        score=float(score),
        arrival_ms=int(arrival),
        assigned_ms=int(assigned),
        first_token_ms=int(first_token) if first_token else None,
        traceparent=traceparent or "",
        tenant=tenant,
        priority=int(priority),
        preemptions=int(preemptions),
        deadline_ms=int(deadline),
        expected_output=int(est_out),
        cached_prompt_tokens=int(cached) if cached else None,
        prefix_root=int(root, 16) if root else ROOT,
    )
