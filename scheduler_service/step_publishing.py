"""Recording an executor step and publishing it to the clients' streams (mixed into ``RequestStore``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT

from common.keys import KeySchema
from common.lifecycle import FinishReason, terminal_state_for
from scheduler_service.requests import TokenEvent
from scheduler_service.script_batcher import ScriptBatcher
from scheduler_service.scripts import MALFORMED


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class StepWrite:
    """One request's share of an executor step: its event, and an error message if it failed."""

    request_id: str
    event: TokenEvent
    error: str = ""


class StreamListener(Protocol):
    """Told of this process's own stream writes (``StreamMux``: hands them to local readers)."""

    def published(self, key: str, entry_id: str, fields: dict[str, str], final: bool) -> None: ...

    def expected(self, key: str) -> None: ...

    def released(self, key: str) -> None: ...


class StepPublishing:
    """Mixed into ``RequestStore``; needs its Redis client, keys, TTL, estimator weight, the
    RECORD_STEP script (group-committed across links by a ``ScriptBatcher``), whether Redis is a
    cluster, and its listener."""

    redis: aioredis.Redis
    keys: KeySchema
    ttl_s: int
    estimator_alpha: float
    listener: StreamListener | None
    _cluster: bool
    _record_step: ScriptBatcher
    quarantine: Callable[..., Awaitable[bool]]  # RequestStore.quarantine

    def expect_local(self, request_id: str) -> None:
        """A link in this process took ``request_id`` with an empty stream: only it will write it."""
        if self.listener is not None:
            self.listener.expected(self.keys.output(request_id))

    async def publish_step(self, executor_id: str, writes: Sequence[StepWrite], owner: str | None = None) -> list[bool]:
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
            if publish_here:
                keys.append(self.keys.output(write.request_id))
                args += (2 * len(entry), *(item for pair in entry.items() for item in pair))
        results = await self._record_step(keys, args)
        for i, write in enumerate(writes):
            if results[3 * i] == MALFORMED:  # refused below; the link aborts it on the executor
                await self.quarantine(write.request_id, "its record in Redis is malformed", executor_id)
        accepted = []
        for i, write in enumerate(writes):
            # FINISH's 2: a retried finish whose first attempt landed; its final event must still go out.
            ok = not write.event.token_ids or int(results[3 * i]) > 0
            if write.event.finish_reason is not none:
                ok = int(results[3 * i + 1]) in (1, 2) and ok
            accepted.append(ok)
        if publish_here:
            entry_ids = [str(results[3 * i + 2]) for i in range(len(writes))]
        else:
            entry_ids = await self._publish_all(writes, fields, accepted, executor_id)
        if self.listener is not None:
            for write, entry, entry_id in zip(writes, fields, entry_ids, strict=True):
                if entry_id:
                    final = write.event.finish_reason is not none
                    self.listener.published(self.keys.output(write.request_id), entry_id, entry, final)
        return accepted

    async def _publish_all(
        self, writes: Sequence[StepWrite], fields: list[dict[str, str]], accepted: list[bool], executor_id: str
    ) -> list[str]:
        """XADD each accepted event to its stream (a cluster's second round trip); their entry ids.

        A stream key of another type fails its own XADD only: that request ends FAILED."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for write, entry, ok in zip(writes, fields, accepted, strict=True):
                if ok:
                    self._add_entry(pipe, write.request_id, write.event, entry)
            replies = iter(await pipe.execute(raise_on_error=False))
        entry_ids = []
        for write, ok in zip(writes, accepted, strict=True):
            reply = next(replies) if ok else ""
            if ok and write.event.finish_reason is not FinishReason.NONE:
                next(replies)  # the EXPIRE's reply
            if isinstance(reply, ResponseError):
                await self.quarantine(write.request_id, "its output stream in Redis is malformed", executor_id)
                reply = ""
            elif isinstance(reply, Exception):
                raise reply
            entry_ids.append(str(reply))
        return entry_ids

    def _add_entry(
        self, pipe: aioredis.client.Pipeline, request_id: str, event: TokenEvent, fields: dict[str, str]
    ) -> None:
        pipe.xadd(self.keys.output(request_id), cast(dict[FieldT, EncodableT], fields))
        if event.finish_reason is not FinishReason.NONE:
            pipe.expire(self.keys.output(request_id), self.ttl_s)
