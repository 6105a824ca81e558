"""Everything the scheduler reads from or writes to Redis, one part per concept:

- ``requests`` (``RequestRecords``): request records and the Lua scripts that move them;
- ``steps`` (``StepPublisher``): an executor step recorded, then published to the clients;
- ``queue`` (``PendingQueue``): reads of the pending queues;
- ``streams`` (``TokenStreams``): the clients' token streams and their shared read;
- ``fleet`` (``FleetRegistry``): the executors' registry and the replicas' leases on them;
- ``prefixes`` (``PrefixIndex``): which KV blocks each executor's prefix cache holds;
- ``control`` (``ControlChannel``): the replicas' pub/sub channel.
- ``tenants`` (``IdleTenants``): forgetting tenants gone idle.

The rest of the scheduler goes through these parts and never calls Redis itself.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from common.keys import KeySchema
from scheduler_service.store.control_channel import ControlChannel
from scheduler_service.store.fleet import FleetRegistry
from scheduler_service.store.idle_tenants import IdleTenants
from scheduler_service.store.prefix_index import PrefixIndex
from scheduler_service.store.queue import PendingQueue
from scheduler_service.store.request_records import RequestRecords
from scheduler_service.store.step_publisher import StepPublisher
from scheduler_service.store.token_streams import TokenStreams


class Store:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: KeySchema,
        request_ttl_s: int,
        max_migrations: int = 3,
        estimator_alpha: float = 0.2,
    ) -> None:
        # The client the parts share. Outside this package only tests and tools touch it, to look
        # at or damage Redis on purpose; the scheduler's own code goes through the parts.
        self.redis = redis
        self.keys = keys
        self.streams = TokenStreams(redis, keys, request_ttl_s)
        self.requests = RequestRecords(redis, keys, self.streams, request_ttl_s, max_migrations, estimator_alpha)
        self.steps = StepPublisher(redis, keys, self.requests, self.streams, request_ttl_s, estimator_alpha)
        self.queue = PendingQueue(redis, keys)
        self.fleet = FleetRegistry(redis, keys)
        self.prefixes = PrefixIndex(redis, keys)
        self.tenants = IdleTenants(redis, keys)
        # Sharded pub/sub on a Redis Cluster, classic elsewhere.
        self.control = ControlChannel(redis, keys.control_channel)

    async def ping(self) -> bool:
        """Whether Redis answers (raises what the client raises when it cannot be reached)."""
        return bool(await self.redis.ping())

    async def close(self) -> None:
        await self.redis.aclose()
