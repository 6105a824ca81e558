"""Parse ``distributed.redis_url`` into what kind of Redis deployment to connect to.

Three shapes, told apart by the scheme:

- ``redis://[user:pass@]host:port/db`` (``rediss://`` for TLS, ``unix://``): one server, exactly
  as redis-py's ``Redis.from_url`` reads it;
- ``redis+cluster://[user:pass@]host:port[,host:port...]`` (``rediss+cluster://``): a Redis
  Cluster, reached through any of the seed nodes listed;
- ``redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db]`` (``rediss+sentinel://``):
  the primary that the listed sentinels name for ``service``, followed across failovers.

The credentials and TLS options are the data nodes'. Sentinels get their own through the
``sentinel_username`` / ``sentinel_password`` query options, as they often run without auth.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from urllib.parse import parse_qsl, unquote, urlsplit


class RedisKind(Enum):
    STANDALONE = "standalone"
    CLUSTER = "cluster"
    SENTINEL = "sentinel"


_SCHEMES = {
    "redis": (RedisKind.STANDALONE, False),
    "rediss": (RedisKind.STANDALONE, True),
    "unix": (RedisKind.STANDALONE, False),
    "redis+cluster": (RedisKind.CLUSTER, False),
    "rediss+cluster": (RedisKind.CLUSTER, True),
    "redis+sentinel": (RedisKind.SENTINEL, False),
    "rediss+sentinel": (RedisKind.SENTINEL, True),
}

# Query options accepted on cluster and sentinel URLs (standalone URLs go to redis-py untouched).
TLS_OPTIONS = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"})
SENTINEL_OPTIONS = frozenset({"sentinel_username", "sentinel_password"})


@dataclass(frozen=True)
class RedisTarget:
    """Where Baton's Redis lives and how to log in; built by ``parse_redis_url``."""

    kind: RedisKind
    url: str  # as configured; a standalone target is opened from it directly
    nodes: tuple[tuple[str, int], ...] = ()  # cluster seed nodes or sentinels
    service_name: str = ""  # sentinel only: the monitored primary's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    options: tuple[tuple[str, str], ...] = ()  # validated query options, in URL order

    def __post_init__(self) -> None:
        if self.kind is not RedisKind.STANDALONE and not self.nodes:
            raise ValueError(f"a {self.kind.value} Redis URL needs at least one host:port")
        if self.kind is RedisKind.SENTINEL and not self.service_name:
            raise ValueError("a redis+sentinel:// URL needs the service name as its path: .../mymaster")
        if self.kind is RedisKind.CLUSTER and self.db != 0:
            raise ValueError("Redis Cluster has only database 0")

    def option(self, name: str) -> str | None:
        return dict(self.options).get(name)

    @property
    def redacted(self) -> str:
        """The URL without its password, for logs."""
        scheme, _, rest = self.url.partition("://")
        netloc, slash, tail = rest.partition("/")
        tail = re.sub(r"(sentinel_password=)[^&]*", r"\1***", tail)
        if "@" in netloc:
            userinfo, _, hosts = netloc.rpartition("@")
            netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
        return f"{scheme}://{netloc}{slash}{tail}"


def _host_port(item: str, default_port: int) -> tuple[str, int]:
    item = item.strip()
    if not item:
        raise ValueError("empty host in Redis URL")
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
    try:
        number = int(port) if port else default_port
    except ValueError:
        raise ValueError(f"bad port in Redis URL host {item!r}") from None
    if not host or not 0 < number < 65536:
        raise ValueError(f"bad host:port in Redis URL: {item!r}")
    return host, number


def _db(text: str) -> int:
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"the Redis database must be a number, not {text!r}")
    return int(text)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse and validate; raise ``ValueError`` saying what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise ValueError(f"unsupported Redis URL scheme in {url!r}; use one of {', '.join(sorted(_SCHEMES))}")
    kind, tls = _SCHEMES[scheme.lower()]
    if kind is RedisKind.STANDALONE:
        return RedisTarget(kind=kind, url=url, tls=tls)
    # urlsplit cannot read a comma-separated host list as a netloc, so split by hand.
    parts = urlsplit(f"x://{rest}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username: str | None = None
    password: str | None = None
    if userinfo:
        user, has_password, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if has_password else None
    default_port = 26379 if kind is RedisKind.SENTINEL else 6379
    nodes = tuple(_host_port(h, default_port) for h in hosts.split(","))
    allowed = TLS_OPTIONS | (SENTINEL_OPTIONS if kind is RedisKind.SENTINEL else frozenset())
    options = tuple(parse_qsl(parts.query, keep_blank_values=True))
    for name, _ in options:
        if name not in allowed:
            raise ValueError(f"unknown option {name!r} in Redis URL; known: {', '.join(sorted(allowed))}")
    path = [unquote(p) for p in parts.path.split("/") if p]
    service, db = "", 0
    if kind is RedisKind.SENTINEL:
        if not 1 <= len(path) <= 2:
            raise ValueError("a redis+sentinel:// URL's path is /service_name or /service_name/db")
        service = path[0]
        db = _db(path[1]) if len(path) == 2 else 0
    elif len(path) > 1:
        raise ValueError("a redis+cluster:// URL's path can only be /0")
    else:
        db = _db(path[0]) if path else 0
    return RedisTarget(kind, url, nodes, service, db, username, password, tls, options)
