"""The clients' token streams: one Redis stream of ``TokenEvent`` entries per request.

Writers append an entry per accepted event (a final one also starts the stream's TTL); readers
follow a stream from an entry id. On a single Redis (or Sentinel) the readers of this replica
share one blocking XREAD through a ``StreamMux``, which is also told of every entry this process
writes, so those reach their readers without a read at all. On a cluster each reader keeps its
own XREAD (see ``stream_mux.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from common.keys import KeySchema
from common.lifecycle import FinishReason
from scheduler_service.requests import TokenEvent
from scheduler_service.store.stream_mux import StreamMux

# One entry to append: the request, its event, and the event as stream fields.
StreamEntry = tuple[str, TokenEvent, dict[str, str]]


class TokenStreams:
    def __init__(self, redis: aioredis.Redis, keys: KeySchema, ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl_s = ttl_s
        # One XREAD for all followed streams (not one per client); per-client reads on a cluster.
        self._mux = StreamMux(redis) if StreamMux.supported(redis) else None

    # ---- writes ------------------------------------------------------------------------
    async def publish_final(self, request_id: str, event: TokenEvent) -> None:
        """Append ``event`` (a final one: its stream's TTL starts) and hand it to local readers."""
        async with self._redis.pipeline(transaction=False) as pipe:
            fields = event.to_fields()
            self._add_entry(pipe, request_id, event, fields)
            entry_id, _ = await pipe.execute()
        self.published_here(request_id, str(entry_id), fields, final=True)

    async def append_all(self, entries: Sequence[StreamEntry]) -> list[object]:
        """XADD each entry to its request's stream in one round trip; each XADD's reply, in order:
        the entry id, or the exception of that XADD alone (a stream key of another type)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id, event, fields in entries:
                self._add_entry(pipe, request_id, event, fields)
            replies = iter(await pipe.execute(raise_on_error=False))
        out: list[object] = []
        for _, event, _ in entries:
            out.append(next(replies))
            if event.finish_reason is not FinishReason.NONE:
                next(replies)  # the EXPIRE's reply
        return out

    def _add_entry(
        self, pipe: aioredis.client.Pipeline, request_id: str, event: TokenEvent, fields: dict[str, str]
    ) -> None:
        pipe.xadd(self._keys.output(request_id), cast(dict[FieldT, EncodableT], fields))
        if event.finish_reason is not FinishReason.NONE:
            pipe.expire(self._keys.output(request_id), self._ttl_s)

    async def is_malformed(self, request_id: str) -> bool:
        """Whether the request's output stream key holds another type than a stream."""
        return await self._redis.type(self._keys.output(request_id)) not in ("stream", "none")

    async def drop(self, request_id: str) -> None:
        """Delete the request's stream key (one of another type, before a fresh stream replaces it)."""
        await self._redis.delete(self._keys.output(request_id))

    # ---- this process's own writers ------------------------------------------------------
    def expect_local(self, request_id: str) -> None:
        """A link in this process took ``request_id`` with an empty stream: only it will write it."""
        if self._mux is not None:
            self._mux.expected(self._keys.output(request_id))

    def release_local(self, request_id: str) -> None:
        """``request_id`` left this process's links: its readers follow Redis again."""
        if self._mux is not None:
            self._mux.released(self._keys.output(request_id))

    def published_here(self, request_id: str, entry_id: str, fields: dict[str, str], final: bool) -> None:
        """This process just added ``entry_id`` to the request's stream: hand it to local readers."""
        if self._mux is not None:
            self._mux.published(self._keys.output(request_id), entry_id, fields, final)

    # ---- reads -------------------------------------------------------------------------
    async def follow(self, request_id: str, after: str, block_ms: int) -> list[tuple[str, TokenEvent]]:
        """What a client following the stream reads next: the events after stream id ``after``,
        waiting up to ``block_ms`` for the first, through the shared read where there is one."""
        if self._mux is None:
            return await self.read_events(request_id, after, block_ms)
        entries = await self._mux.read(self._keys.output(request_id), after, block_ms)
        return [(entry_id, TokenEvent.from_fields(fields)) for entry_id, fields in entries]

    async def read_events(self, request_id: str, after: str, block_ms: int) -> list[tuple[str, TokenEvent]]:
        """One XREAD of the stream: events after stream id ``after`` ("0" for all), waiting up to
        ``block_ms`` for the first."""
        reply = cast(
            list[tuple[str, list[tuple[str, dict[str, str]]]]],
            await self._redis.xread({self._keys.output(request_id): after}, count=512, block=block_ms),
        )
        if not reply:
            return []
        _, entries = reply[0]
        return [(entry_id, TokenEvent.from_fields(fields)) for entry_id, fields in entries]
