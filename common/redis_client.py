"""Redis connections with retry and backoff, shared by both services.

``connect`` opens whichever deployment ``distributed.redis_url`` names (see ``common.redis_url``):
one server, a Redis Cluster, or a Sentinel-managed primary. All three answer the same commands,
so the rest of Baton holds the result as a plain ``redis.asyncio.Redis``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode as SyncClusterNode
from redis.exceptions import ClusterDownError, ReadOnlyError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import Sentinel as SyncSentinel

from common.errors import NotReady
from common.redis_cluster import BatonRedisCluster
from common.redis_packing import use_c_packing
from common.redis_url import TLS_OPTIONS, RedisKind, RedisTarget, parse_redis_url

log = logging.getLogger(__name__)
T = TypeVar("T")

# What a failover or restart looks like from a client: worth waiting out, not worth failing for.
# ReadOnlyError: a write reached a primary that was just demoted to replica.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    TryAgainError,
    ReadOnlyError,
)


def _retry() -> Retry:
    return Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3)


def _tls_kwargs(target: RedisTarget) -> dict[str, Any]:
    if not target.tls:
        return {}
    kwargs: dict[str, Any] = {"ssl": True}
    for name in TLS_OPTIONS:
        value = target.option(name)
        if value is not None:
            kwargs[name] = value.lower() in ("1", "true", "yes") if name == "ssl_check_hostname" else value
    return kwargs


def connect(url: str, max_connections: int = 512) -> aioredis.Redis:
    """A pooled client for ``url`` that retries transient connection errors with exponential backoff."""
    target = parse_redis_url(url)
    if target.kind is RedisKind.CLUSTER:
        return _connect_cluster(target, max_connections)
    if target.kind is RedisKind.SENTINEL:
        return _connect_sentinel(target, max_connections)
    # A blocking pool: past max_connections a caller waits for a free connection (up to 30 s)
    # instead of failing with "Too many connections", which a burst of 1,000 clients hit.
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        max_connections=max_connections,
        timeout=30,
        health_check_interval=15,
        socket_connect_timeout=2.0,
        retry=_retry(),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    return aioredis.Redis.from_pool(use_c_packing(pool))


def _connect_cluster(target: RedisTarget, max_connections: int) -> aioredis.Redis:
    log.info("Redis Cluster via %s", target.redacted)
    cluster = BatonRedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
        username=target.username,
        password=target.password,
        decode_responses=True,
        max_connections=max_connections,  # per node
        health_check_interval=15,
        socket_connect_timeout=2.0,
        retry=_retry(),
        **_tls_kwargs(target),
    )
    # RedisCluster answers every command Baton uses with the same shape as Redis; callers
    # that must differ (pub/sub on the control channel) ask ``is_cluster``.
    return cast(aioredis.Redis, cluster)


def _connect_sentinel(target: RedisTarget, max_connections: int) -> aioredis.Redis:
    log.info("Redis via Sentinel %s", target.redacted)
    sentinel_auth = {
        k: v
        for k, v in (
            ("username", target.option("sentinel_username")),
            ("password", target.option("sentinel_password")),
        )
        if v
    }
    sentinel = Sentinel(
        list(target.nodes),
        sentinel_kwargs={"socket_connect_timeout": 1.0, "socket_timeout": 1.0, **sentinel_auth},
    )
    # The pool asks the sentinels for the primary on every new connection, and a write that
    # reaches a demoted primary drops the connection (ReadOnlyError -> ConnectionError), so a
    # failover looks like a short outage that ``with_redis_retry`` rides out.
    return sentinel.master_for(
        target.service_name,
        db=target.db,
        username=target.username,
        password=target.password,
        decode_responses=True,
        max_connections=max_connections,
        health_check_interval=15,
        socket_connect_timeout=2.0,
        retry=_retry(),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        **_tls_kwargs(target),
    )


def connect_sync(url: str) -> redis.Redis:
    """A blocking client for the CLI (``baton inspect``), for any of the three URL shapes."""
    target = parse_redis_url(url)
    if target.kind is RedisKind.CLUSTER:
        nodes = [SyncClusterNode(host, port) for host, port in target.nodes]
        cluster = redis.RedisCluster(
            startup_nodes=nodes,
            username=target.username,
            password=target.password,
            decode_responses=True,
            **_tls_kwargs(target),
        )
        return cast(redis.Redis, cluster)
    if target.kind is RedisKind.SENTINEL:
        sentinel_auth = {"password": target.option("sentinel_password")} if target.option("sentinel_password") else {}
        manager = SyncSentinel(list(target.nodes), sentinel_kwargs=sentinel_auth)
        return manager.master_for(
            target.service_name,
            db=target.db,
            username=target.username,
            password=target.password,
            decode_responses=True,
            **_tls_kwargs(target),
        )
    return redis.Redis.from_url(url, decode_responses=True)


_UNANSWERED: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, TimeoutError, OSError)


async def check_deployment(client: aioredis.Redis, url: str, timeout_s: float = 2.0) -> None:
    """Refuse, at start-up, a Redis Cluster node reached through a single-server URL.

    Such a client would send every key to that one node and get MOVED for most of them, forever:
    an endless loop of warnings in the services and INTERNAL errors for clients. A Redis that does
    not answer yet is not judged here (the services ride out an outage); one that answers and
    says it is a cluster node is a configuration error, and the message names the fix.
    """
    target = parse_redis_url(url)
    if target.kind is not RedisKind.STANDALONE:
        return
    try:
        info = await asyncio.wait_for(client.info("cluster"), timeout_s)
    except _UNANSWERED as exc:
        log.warning("Redis at %s did not answer at start-up (%s); not checked for cluster mode", target.redacted, exc)
        return
    if int(cast(dict[str, Any], info).get("cluster_enabled", 0)) == 1:
        raise ValueError(
            f"distributed.redis_url {target.redacted} is a Redis Cluster node, but a redis:// URL speaks to one "
            f"server; use redis+cluster://HOST:PORT[,HOST:PORT...] so keys are routed to their shards"
        )


def is_cluster(client: object) -> bool:
    """Whether ``client`` talks to a Redis Cluster (whose pub/sub is sharded, see the control channel)."""
    return isinstance(client, (aioredis.RedisCluster, redis.RedisCluster))


async def with_redis_retry(operation: Callable[[], Awaitable[T]], give_up_s: float, what: str) -> T:
    """Run ``operation``, retrying transient errors with backoff for up to ``give_up_s`` seconds.

    This is how Baton rides out a Redis restart or failover: callers pause instead of failing, and
    only an outage longer than ``give_up_s`` surfaces, as NotReady (UNAVAILABLE to clients).
    """
    give_up = time.monotonic() + give_up_s
    delay = 0.05
    while True:
        try:
            return await operation()
        except TRANSIENT_ERRORS as exc:
            if time.monotonic() >= give_up:
                raise NotReady(f"Redis is unavailable ({what})") from exc
            log.warning("%s: Redis unavailable (%s); retrying in %.2f s", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
