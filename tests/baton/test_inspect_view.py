"""`baton inspect`: depth by priority/tenant, oldest waiting, token and finished totals, the live view."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis
from rich.console import Console

from baton import cli
from baton.client_commands import collect_inspection
from baton.inspect_view import rates, render, watch

P = "{baton}"


def _request(client: redis.Redis, rid: str, state: str, priority: int, tenant: str, arrival_ms: int) -> None:
    fields: dict[Any, Any] = {
        "state": state,
        "priority": str(priority),
        "tenant": tenant,
        "arrival_ms": str(arrival_ms),
    }
    client.hset(f"{P}:req:{rid}", mapping=fields)


def _populate(url: str) -> int:
    """Three queued, one running with 5 tokens, two finished (3 and 4 tokens), one failed; one executor."""
    client = redis.Redis.from_url(url, decode_responses=True)
    now = int(time.time() * 1000)
    queued = [("q1", 9, "acme", now - 2_000), ("q2", 5, "acme", now - 30_000), ("q3", 5, "", now - 500)]
    for rid, priority, tenant, arrival in queued:
        _request(client, rid, "QUEUED", priority, tenant, arrival)
        client.zadd(f"{P}:queue:pending", {rid: arrival - priority * 1000})
    _request(client, "r1", "RUNNING", 5, "beta", now - 60_000)
    client.rpush(f"{P}:req:r1:tokens", *range(5))
    _request(client, "f1", "FINISHED", 5, "beta", now - 90_000)
    client.rpush(f"{P}:req:f1:tokens", *range(3))
    _request(client, "f2", "CANCELLED", 5, "acme", now - 90_000)
    client.rpush(f"{P}:req:f2:tokens", *range(4))
    _request(client, "f3", "FAILED", 5, "acme", now - 90_000)
    load = {"num_running": 1, "kv_blocks_used": 25, "kv_blocks_total": 100, "step_time_ms": 12.5, "iteration": 7}
    client.zadd(f"{P}:executors", {"exec-a": now - 1_500})
    client.hset(
        f"{P}:executor:exec-a",
        mapping={"address": "10.0.0.1:7000", "kv_blocks_total": "100", "max_batch_size": "8", "load": json.dumps(load)},
    )
    client.sadd(f"{P}:executor:exec-a:running", "r1")
    client.set(f"{P}:lease:executor:exec-a", "replica-1", px=10_000)
    client.close()
    return now


def _text(renderable: Any) -> str:
    console = Console(record=True, width=160)
    console.print(renderable)
    return console.export_text()


def test_collect_inspection_new_figures(redis_url: str) -> None:
    now = _populate(redis_url)
    snap = collect_inspection(redis_url, "baton")
    assert snap["queue_length"] == 3
    assert snap["queue_sampled"] == 3
    assert snap["depth_by_priority"] == {"9": 1, "5": 2}
    assert list(snap["depth_by_priority"]) == ["9", "5"]  # higher priority first
    assert snap["depth_by_tenant"] == {"": 1, "acme": 2}
    oldest = snap["oldest_waiting"]
    assert oldest["id"] == "q2"
    assert oldest["arrival_ms"] == now - 30_000
    assert 30_000 <= oldest["age_ms"] < 40_000
    assert snap["tokens_total"] == 12
    assert snap["finished_total"] == 3
    assert snap["requests_by_state"] == {"QUEUED": 3, "RUNNING": 1, "FINISHED": 1, "CANCELLED": 1, "FAILED": 1}
    (ex,) = snap["executors"]
    assert ex["kv_used_pct"] == 25.0
    assert ex["max_batch_size"] == 8
    assert ex["running"] == 1
    assert ex["lease"] == "replica-1"
    json.dumps(snap)  # stays plain data


def test_queue_sampling_is_bounded(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    now = int(time.time() * 1000)
    for i in range(12):
        _request(client, f"q{i}", "QUEUED", i % 3, f"t{i % 2}", now - i)
        client.zadd(f"{P}:queue:pending", {f"q{i}": i})
    client.close()
    snap = collect_inspection(redis_url, "baton", queue_sample=5)
    assert snap["queue_length"] == 12
    assert snap["queue_sampled"] == 5
    assert sum(snap["depth_by_priority"].values()) == 5
    assert snap["oldest_waiting"]["id"] == "q4"  # the oldest among the first five queued
    assert "(sampled first 5)" in _text(render(snap))


def test_empty_redis(redis_url: str) -> None:
    snap = collect_inspection(redis_url, "baton")
    assert snap["queue_length"] == 0
    assert snap["depth_by_priority"] == {}
    assert snap["oldest_waiting"] is None
    assert snap["tokens_total"] == 0
    assert snap["finished_total"] == 0
    assert "pending queue: 0 requests" in _text(render(snap))


def test_render_contains_figures(redis_url: str) -> None:
    _populate(redis_url)
    first = collect_inspection(redis_url, "baton")
    second = {**first, "collected_ms": first["collected_ms"] + 2_000, "tokens_total": 32, "finished_total": 4}
    rate = rates(first, second)
    assert rate == {"tokens_per_s": 10.0, "finished_per_s": 0.5}
    text = _text(render(second, rate))
    for figure in ("pending queue: 3 requests", "oldest waiting: q2", "10.0 tokens/s", "0.50 finished/s"):
        assert figure in text
    for figure in ("exec-a", "10.0.0.1:7000", "25.0%", "12.5", "1/8", "replica-1", "acme", "(none)"):
        assert figure in text
    assert "sampled" not in text
    assert "measuring" in _text(render(first, rates(None, first)))


def test_rates_ignore_expired_records() -> None:
    before = {"collected_ms": 0, "tokens_total": 100, "finished_total": 10}
    after = {"collected_ms": 1_000, "tokens_total": 40, "finished_total": 12}
    assert rates(before, after) == {"tokens_per_s": 0.0, "finished_per_s": 2.0}
    assert rates(after, after) is None


def test_watch_stops_on_ctrl_c() -> None:
    calls = 0

    def collect() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        return {"collected_ms": calls, "queue_length": 0, "tokens_total": 0, "finished_total": 0}

    assert watch(collect, interval=0.0, console=Console(record=True, width=160)) == 0
    assert calls == 2


def test_cli_watch(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _populate(redis_url)
    argv = ["inspect", "--watch", "--iterations", "2", "--interval", "0.05", "--redis-url", redis_url]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("pending queue: 3 requests") == 2  # no TTY: every frame is printed
    assert "exec-a" in out
    assert "tokens/s" in out


def test_cli_plain_and_json(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _populate(redis_url)
    assert cli.main(["inspect", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "by priority: 9: 1, 5: 2" in out
    assert "by tenant: (none): 1, acme: 2" in out
    assert "oldest waiting: q2" in out
    assert "tokens total: 12, finished total: 3" in out
    assert "25.0" in out
    assert cli.main(["inspect", "--json", "--redis-url", redis_url]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_total"] == 12


def test_prefix_cache_hit_rate_and_index_size(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _populate(redis_url)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    load = {"num_running": 2, "kv_blocks_used": 10, "kv_blocks_total": 100, "step_time_ms": 3.0}
    load |= {"prefix_cache_queries": 4_000, "prefix_cache_hits": 3_000}
    client.zadd(f"{P}:executors", {"exec-b": int(time.time() * 1000)})
    client.hset(f"{P}:executor:exec-b", mapping={"address": "10.0.0.2:7000", "load": json.dumps(load)})
    client.sadd(f"{P}:prefix:executor:exec-b", "a1", "b2", "c3")
    client.close()
    snap = collect_inspection(redis_url, "baton")
    by_id = {ex["id"]: ex for ex in snap["executors"]}
    assert (by_id["exec-b"]["prefix_hit_pct"], by_id["exec-b"]["prefix_index_blocks"]) == (75.0, 3)
    assert (by_id["exec-a"]["prefix_hit_pct"], by_id["exec-a"]["prefix_index_blocks"]) == (None, 0)  # no lookups
    text = _text(render(snap))
    assert "75.0% (3)" in text
    assert cli.main(["inspect", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "hit %" in out and "75.0" in out


def test_a_stopped_executor_waiting_for_the_reaper_shows_as_stopped(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A clean stop leaves the executor registered at score 0, its record gone, until a scheduler reaps it."""
    _populate(redis_url)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.zadd(f"{P}:executors", {"exec-stopped": 0})
    client.close()
    snap = collect_inspection(redis_url, "baton")
    stopped = next(ex for ex in snap["executors"] if ex["id"] == "exec-stopped")
    assert stopped["heartbeat_age_ms"] is None
    assert "exec-stopped" in _text(render(snap)) and "stopped" in _text(render(snap))
    assert cli.main(["inspect", "--redis-url", redis_url]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "exec-stopped" in line)
    assert "stopped" in line
