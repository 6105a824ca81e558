"""Parsing ``distributed.redis_url``: one server, a Redis Cluster, or Sentinel."""

from __future__ import annotations

import pytest

from common.redis_url import RedisKind, parse_redis_url


def test_standalone_urls_pass_through() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://:pw@host:6380/2?ssl_ca_certs=/ca.pem", "unix:///tmp/r.sock"):
        target = parse_redis_url(url)
        assert target.kind is RedisKind.STANDALONE
        assert target.url == url


def test_cluster_seed_nodes_and_credentials() -> None:
    target = parse_redis_url("redis+cluster://user:p%40ss@10.0.0.1:7000,10.0.0.2,[fd00::3]:7002")
    assert target.kind is RedisKind.CLUSTER
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("fd00::3", 7002))
    assert (target.username, target.password, target.tls) == ("user", "p@ss", False)
    assert target.redacted == "redis+cluster://user:***@10.0.0.1:7000,10.0.0.2,[fd00::3]:7002"


def test_cluster_tls_options() -> None:
    target = parse_redis_url("rediss+cluster://:pw@node:6380/0?ssl_ca_certs=/certs/ca.pem")
    assert target.tls and target.password == "pw" and target.username is None
    assert target.option("ssl_ca_certs") == "/certs/ca.pem"


def test_sentinel_service_db_and_sentinel_password() -> None:
    target = parse_redis_url("redis+sentinel://:pw@s1:26379,s2/mymaster/3?sentinel_password=spw")
    assert target.kind is RedisKind.SENTINEL
    assert target.nodes == (("s1", 26379), ("s2", 26379))
    assert (target.service_name, target.db, target.password) == ("mymaster", 3, "pw")
    assert target.option("sentinel_password") == "spw"
    assert "spw" not in target.redacted and "pw@" not in target.redacted


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("memcached://x", "scheme"),
        ("redis+sentinel://s1:26379", "service_name"),
        ("redis+sentinel://s1:26379/a/b/c", "service_name"),
        ("redis+cluster://", "host"),
        ("redis+cluster://n1:notaport", "port"),
        ("redis+cluster://n1:70000", "host:port"),
        ("redis+cluster://n1/2", "database 0"),
        ("redis+cluster://n1?sentinel_password=x", "unknown option"),
        ("redis+sentinel://s1/m/x", "number"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_redis_url(url)
