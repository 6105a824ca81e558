"""``baton inspect``'s figures beyond the basics, and its live view (``--watch``).

The data helpers read Redis in the documented key schema (README, "Redis key schema") and
return plain dicts, so ``collect_inspection`` stays pure data for the table, JSON and live
outputs alike. Rates (tokens/s, finished/s) come from the difference between two snapshots:
they are approximate, since they only count requests whose records have not expired yet.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

FINISHED_STATES = frozenset({"FINISHED", "CANCELLED", "FAILED"})
_BATCH = 1000


def sample_queue(client: Any, pending_key: str, request_key: Callable[[str], str], now_ms: float, limit: int) -> dict:
    """Depth by priority and tenant, and the oldest waiting request, over the first ``limit`` queued ids."""
    ids: list[str] = client.zrange(pending_key, 0, limit - 1) if limit > 0 else []
    pipe = client.pipeline(transaction=False)
    for rid in ids:
        pipe.hmget(request_key(rid), "priority", "tenant", "arrival_ms")
    rows = pipe.execute() if ids else []
    by_priority: Counter[str] = Counter()
    by_tenant: Counter[str] = Counter()
    oldest: dict[str, Any] | None = None
    for rid, (priority, tenant, arrival) in zip(ids, rows, strict=True):
        by_priority[priority if priority is not None else "?"] += 1
        by_tenant[tenant or ""] += 1
        if arrival is None:
            continue
        arrival_ms = int(float(arrival))
        if oldest is None or arrival_ms < oldest["arrival_ms"]:
            oldest = {"id": rid, "arrival_ms": arrival_ms, "age_ms": max(0, round(now_ms - arrival_ms))}
    return {
        "queue_sampled": len(ids),
        "depth_by_priority": dict(sorted(by_priority.items(), key=lambda kv: _priority_order(kv[0]))),
        "depth_by_tenant": dict(sorted(by_tenant.items())),
        "oldest_waiting": oldest,
    }


def _priority_order(priority: str) -> tuple[int, float]:
    """Higher priority first; unparsable values last."""
    try:
        return (0, -float(priority))
    except ValueError:
        return (1, 0.0)


def scan_requests(client: Any, request_pattern: str, scan_limit: int) -> dict:
    """Requests by state, ``finished_total`` and ``tokens_total`` over at most ``scan_limit`` SCANned keys."""
    depth = request_pattern.count(":")
    hashes: list[str] = []
    token_lists: list[str] = []
    states: Counter[str] = Counter()
    tokens_total = 0

    def flush() -> None:
        nonlocal tokens_total
        pipe = client.pipeline(transaction=False)
        for key in hashes:
            pipe.hget(key, "state")
        for key in token_lists:
            pipe.llen(key)
        results = pipe.execute() if hashes or token_lists else []
        for state in results[: len(hashes)]:
            states[state or "?"] += 1
        tokens_total += sum(int(n or 0) for n in results[len(hashes) :])
        hashes.clear()
        token_lists.clear()

    for scanned, key in enumerate(client.scan_iter(match=request_pattern, count=1000)):
        if scanned >= scan_limit:
            break
        colons = key.count(":")
        if colons == depth:
            hashes.append(key)
        elif colons == depth + 1 and key.endswith(":tokens"):
            token_lists.append(key)
        if len(hashes) + len(token_lists) >= _BATCH:
            flush()
    flush()
    return {
        "requests_by_state": dict(states),
        "finished_total": sum(n for state, n in states.items() if state in FINISHED_STATES),
        "tokens_total": tokens_total,
    }


def scheduling_state(client: Any, keys: Any) -> dict:
    """Tenants' virtual token counters, queued and running counts, and the length estimator."""
    counters = client.hgetall(keys.tenant_counters)
    running = client.hgetall(keys.tenant_running)
    waiting = dict(client.zrange(keys.tenants_waiting, 0, -1, withscores=True))
    tenants = {
        t: {
            "counter": float(counters.get(t, 0.0)),
            "waiting": client.zcard(keys.tenant_queue(t)) if t in waiting else 0,
            "running": int(running.get(t, 0)),
        }
        for t in sorted(set(counters) | set(running) | set(waiting))
    }
    raw = client.hgetall(keys.estimator)
    estimator = {}
    for name in sorted(raw):
        key, _, field = name.rpartition(":")
        if field == "n":
            estimator[key] = {
                "samples": int(raw[name]),
                "mean": float(raw.get(f"{key}:mean", 0.0)),
                "abs_error": float(raw.get(f"{key}:err", 0.0)),
            }
    return {"tenants": tenants, "estimator": estimator}


def kv_percent(load: Mapping[str, Any], record: Mapping[Any, Any]) -> float | None:
    """KV cache blocks in use as a percentage, or None when the total is unknown."""
    total = float(load.get("kv_blocks_total") or record.get("kv_blocks_total") or 0)
    return round(100.0 * float(load.get("kv_blocks_used", 0)) / total, 1) if total > 0 else None


def prefix_hit_percent(load: Mapping[str, Any]) -> float | None:
    """Prompt tokens found in the executor's prefix cache, as a percentage of those looked up
    since it started (its ``load`` record's ``prefix_cache_hits``/``prefix_cache_queries``);
    None when it has looked up none or does not report them."""
    queries = float(load.get("prefix_cache_queries") or 0)
    return round(100.0 * float(load.get("prefix_cache_hits") or 0) / queries, 1) if queries > 0 else None


def rates(previous: Mapping[str, Any] | None, current: Mapping[str, Any]) -> dict[str, float] | None:
    """Tokens and finished requests per second between two snapshots (negative deltas, from expiry, count 0)."""
    if previous is None:
        return None
    seconds = (current["collected_ms"] - previous["collected_ms"]) / 1000
    if seconds <= 0:
        return None
    return {
        "tokens_per_s": max(0, current["tokens_total"] - previous["tokens_total"]) / seconds,
        "finished_per_s": max(0, current["finished_total"] - previous["finished_total"]) / seconds,
    }


def format_age(ms: float) -> str:
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 120_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"


def sample_note(snapshot: Mapping[str, Any]) -> str:
    sampled = snapshot.get("queue_sampled", 0)
    return f" (sampled first {sampled})" if snapshot.get("queue_length", 0) > sampled else ""


def tenant_label(tenant: str) -> str:
    return tenant or "(none)"


def _counts_table(title: str, column: str, counts: Mapping[str, int], label: Callable[[str], str], note: str) -> Table:
    table = Table(title=title, title_justify="left", min_width=24, caption=note.strip() or None, caption_justify="left")
    table.add_column(column)
    table.add_column("queued", justify="right")
    for key, count in counts.items():
        table.add_row(label(key), str(count))
    return table


def _executors_table(executors: Iterable[Mapping[str, Any]]) -> Table:
    table = Table(title="executors", title_justify="left")
    for name in ("id", "address", "load", "kv used", "cache", "step ms", "running", "heartbeat", "lease"):
        table.add_column(name, justify="left" if name in ("id", "address", "lease") else "right", no_wrap=name == "id")
    for ex in executors:
        load = ex.get("load", {})
        batch = ex.get("max_batch_size") or 0
        busy = f"{load.get('num_running', 0)}/{batch}" if batch else str(load.get("num_running", 0))
        kv = ex.get("kv_used_pct")
        kv_text = (
            f"{kv:.1f}% ({load.get('kv_blocks_used', 0)}/{load.get('kv_blocks_total', 0)})" if kv is not None else "-"
        )
        # The prefix cache's hit rate, and the blocks the fleet's index holds for it in brackets.
        hit = ex.get("prefix_hit_pct")
        cache = f"{'-' if hit is None else f'{hit:.1f}%'} ({ex.get('prefix_index_blocks', 0)})"
        table.add_row(
            ex["id"],
            ex.get("address", ""),
            busy,
            kv_text,
            cache,
            f"{float(load.get('step_time_ms', 0.0)):.1f}",
            str(ex.get("running", 0)),
            "stopped" if ex.get("heartbeat_age_ms", 0) is None else format_age(ex.get("heartbeat_age_ms", 0)),
            ex.get("lease") or "-",
        )
    return table


def render(snapshot: Mapping[str, Any], rate: Mapping[str, float] | None = None) -> RenderableType:
    """One frame of the live view: queue summary, depth by priority and tenant, executors, throughput."""
    note = sample_note(snapshot)
    lines = [f"pending queue: {snapshot['queue_length']} requests{note}"]
    oldest = snapshot.get("oldest_waiting")
    if oldest:
        lines.append(f"oldest waiting: {oldest['id']} for {format_age(oldest['age_ms'])}")
    if rate is None:
        lines.append("throughput: measuring (needs two refreshes)")
    else:
        lines.append(
            f"throughput: {rate['tokens_per_s']:.1f} tokens/s, {rate['finished_per_s']:.2f} finished/s (approximate)"
        )
    lines.append(
        f"tokens total: {snapshot.get('tokens_total', 0)}, finished total: {snapshot.get('finished_total', 0)}"
    )
    states = ", ".join(f"{k} {v}" for k, v in sorted(snapshot.get("requests_by_state", {}).items())) or "none"
    lines.append(f"requests by state: {states}")
    depth = Table.grid(padding=(0, 4))
    depth.add_row(
        _counts_table("by priority", "priority", snapshot.get("depth_by_priority", {}), str, note),
        _counts_table("by tenant", "tenant", snapshot.get("depth_by_tenant", {}), tenant_label, note),
    )
    return Group(Text("\n".join(lines)), depth, _executors_table(snapshot.get("executors", [])))


def watch(
    collect: Callable[[], dict[str, Any]],
    interval: float = 1.0,
    iterations: int = 0,
    console: Console | None = None,
) -> int:
    """Refresh every ``interval`` seconds, ``iterations`` times (0: until Ctrl-C). Returns 0.

    On a terminal the frame is redrawn in place (rich.live.Live); without one (a pipe, a log
    file) every frame is printed in turn, so nothing is lost.
    """
    console = console or Console()
    live = Live(console=console, auto_refresh=False, transient=False) if console.is_terminal else None
    previous: dict[str, Any] | None = None
    done = 0
    try:
        with live or nullcontext():
            while True:
                snapshot = collect()
                frame = render(snapshot, rates(previous, snapshot))
                if live is not None:
                    live.update(frame, refresh=True)
                else:
                    console.print(frame)
                previous = snapshot
                done += 1
                if iterations and done >= iterations:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0
