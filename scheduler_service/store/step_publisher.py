"""Recording an executor step in the request records, then publishing it to the clients' streams."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import EncodableT

from common.clock import now_ms
from common.keys import KeySchema
from common.lifecycle import FinishReason, terminal_state_for
from common.redis_client import is_cluster
from scheduler_service.requests import TokenEvent
from scheduler_service.store import request_scripts
from scheduler_service.store.request_records import RequestRecords
from scheduler_service.store.script_batcher import ScriptBatcher
from scheduler_service.store.token_streams import TokenStreams


@dataclass(frozen=True)
class StepWrite:
    """One request's share of an executor step: its event, and an error message if it failed."""

    request_id: str
    event: TokenEvent
    error: str = ""
    # On the first write of an admission's tokens: the prompt tokens the request found cached,
    # which its record keeps from the first such write on (the usage's cached tokens).
    cached_tokens: int | None = None


@dataclass(frozen=True)
class StepRecord:
    """What Redis made of one step's writes."""

    accepted: list[bool]  # per write: recorded (and published)
    # Requests whose tokens were recorded while a cancel was pending for them: a cancel that landed
    # while they were being claimed or admitted, whose abort never reached their executor.
    cancel_pending: list[str]


class StepPublisher:
    """Runs RECORD_STEP (group-committed across links by a ``ScriptBatcher``), ends the requests
    it finds malformed through ``RequestRecords.quarantine``, and appends to ``TokenStreams``."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: KeySchema,
        requests: RequestRecords,
        streams: TokenStreams,
        ttl_s: int,
        estimator_alpha: float,
    ) -> None:
        self.keys = keys
        self.ttl_s = ttl_s
        self.estimator_alpha = estimator_alpha
        self._requests = requests
        self._streams = streams
        # Every link records every step: their calls share round trips (see ScriptBatcher).
        self._record_step = ScriptBatcher(redis, redis.register_script(request_scripts.RECORD_STEP))
        self._cluster = is_cluster(redis)

    async def publish(self, executor_id: str, writes: Sequence[StepWrite], owner: str | None = None) -> StepRecord:
        """Record one executor step, then publish what was accepted to the clients' streams.

        The guarded script decides first, so an executor that no longer owns a request (it was
        re-queued elsewhere) can never reach that client's stream. One RECORD_STEP call covers
        the whole step (APPEND_TOKENS, then FINISH, per request) and, on a single Redis, the
        stream entries too. On a cluster the streams live outside the hash tag (spread over the
        shards), so they are written by a second round trip.
        """
        publish_here = not self._cluster
        keys = [
            self.keys.running(executor_id),
            self.keys.pending,
            self.keys.tenants_waiting,
            self.keys.tenant_counters,
            self.keys.tenant_running,
            self.keys.estimator,
        ]
        finish_owner = executor_id if owner is None else owner
        args: list[EncodableT] = [
            owner or executor_id,
            finish_owner,
            now_ms(),
            self.ttl_s,
            self.keys.tenant_queue_prefix,
            self.estimator_alpha,
            "1" if publish_here else "0",
        ]
        none = FinishReason.NONE
        fields = [write.event.to_fields() for write in writes]
        for write, entry in zip(writes, fields, strict=True):
            event = write.event
            keys += (self.keys.request(write.request_id), self.keys.tokens(write.request_id))
            args += (write.request_id, event.index, len(event.token_ids), *event.token_ids)
            if event.finish_reason is none:
                args += ("", "", "")
            else:
                args += (terminal_state_for(event.finish_reason).name, event.finish_reason.name, write.error)
            args.append("" if write.cached_tokens is None else write.cached_tokens)
            if publish_here:
                keys.append(self.keys.output(write.request_id))
                args += (2 * len(entry), *(item for pair in entry.items() for item in pair))
        results = await self._record_step(keys, args)
        for i, write in enumerate(writes):
            if results[3 * i] == request_scripts.MALFORMED:  # refused below; the link aborts it on the executor
                await self._requests.quarantine(write.request_id, "its record in Redis is malformed", executor_id)
        accepted, cancel_pending = [], []
        for i, write in enumerate(writes):
            # FINISH's 2: a retried finish whose first attempt landed; its final event must still go out.
            appended = int(results[3 * i])
            ok = appended > 0 if write.event.token_ids else appended == 0
            if write.event.finish_reason is not none:
                ok = int(results[3 * i + 1]) in (1, 2) and ok
            elif ok and int(results[3 * i + 1]) == request_scripts.CANCEL_PENDING:
                cancel_pending.append(write.request_id)
            accepted.append(ok)
        if publish_here:
            entry_ids = [str(results[3 * i + 2]) for i in range(len(writes))]
        else:
            entry_ids = await self._publish_all(writes, fields, accepted, executor_id)
        for write, entry, entry_id in zip(writes, fields, entry_ids, strict=True):
            if entry_id:
                final = write.event.finish_reason is not none
                self._streams.published_here(write.request_id, entry_id, entry, final)
        return StepRecord(accepted, cancel_pending)

    async def _publish_all(
        self, writes: Sequence[StepWrite], fields: list[dict[str, str]], accepted: list[bool], executor_id: str
    ) -> list[str]:
        """XADD each accepted event to its stream (a cluster's second round trip); their entry ids.

        A stream key of another type fails its own XADD only: that request ends FAILED."""
        entries = [(w.request_id, w.event, entry) for w, entry, ok in zip(writes, fields, accepted, strict=True) if ok]
        replies = iter(await self._streams.append_all(entries))
        entry_ids = []
        for write, ok in zip(writes, accepted, strict=True):
            reply = next(replies) if ok else ""
            if isinstance(reply, ResponseError):
                await self._requests.quarantine(
                    write.request_id, "its output stream in Redis is malformed", executor_id
                )
                reply = ""
            elif isinstance(reply, Exception):
                raise reply
            entry_ids.append(str(reply))
        return entry_ids
