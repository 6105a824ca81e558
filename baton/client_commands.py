"""Client-side subcommands: generate (streams to the terminal), health, inspect."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

import grpc


def tls_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS when --tls-ca is given (with --tls-cert/--tls-key for mTLS); None: plaintext."""
    ca = getattr(args, "tls_ca", None)
    if not ca:
        return None
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext, or TLS when --tls-ca is given (``tls_credentials``)."""
    credentials = tls_credentials(args)
    if credentials is None:
        return grpc.insecure_channel(args.target)
    return grpc.secure_channel(args.target, credentials)


def _metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    token = getattr(args, "token", None) or os.environ.get("BATON_TOKEN", "")
    return [("authorization", f"Bearer {token}")] if token else []


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", help="CA certificate (PEM) to verify the scheduler; enables TLS")
    parser.add_argument("--tls-cert", help="client certificate (PEM) for mTLS")
    parser.add_argument("--tls-key", help="client private key (PEM) for mTLS")


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    add_tls_flags(parser)
    parser.add_argument("--token", help="bearer token for the API (default: $BATON_TOKEN)")


def generate(args: argparse.Namespace) -> int:
    from common.pb import generate_pb2 as pb
    from common.pb import generate_pb2_grpc

    request = pb.GenerateRequest(
        prompt=args.prompt,
        params=pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos),
        priority=args.priority,
        tenant=args.tenant,
    )
    with open_channel(args) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            for chunk in stub.Generate(request, metadata=_metadata(args)):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    usage = chunk.usage
                    reason = pb.FinishReason.Name(chunk.finish_reason)
                    print(
                        f"\n[{reason}: {usage.completion_tokens} tokens, ttft {usage.ttft_ms:.0f} ms]", file=sys.stderr
                    )
        except grpc.RpcError as exc:
            print(f"\nbaton: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def health(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_channel(args) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def collect_inspection(
    redis_url: str, prefix: str, top: int = 10, scan_limit: int = 100_000, queue_sample: int = 1000
) -> dict[str, Any]:
    """A snapshot of Baton's Redis state as plain data: queue (head, depth by priority and tenant over
    the first ``queue_sample`` ids, oldest waiting), executors with load, requests by state, and the
    ``tokens_total``/``finished_total`` counts (over at most ``scan_limit`` keys) that rates derive from."""
    from baton.inspect_view import kv_percent, prefix_hit_percent, sample_queue, scan_requests, scheduling_state
    from common.keys import KeySchema
    from common.redis_client import connect_sync

    keys = KeySchema(prefix)
    client = connect_sync(redis_url)  # one server, redis+cluster:// or redis+sentinel://
    try:
        now = time.time() * 1000
        # decode_responses=True: members and hash fields come back as str.
        queued = cast(list[tuple[str, float]], client.zrange(keys.pending, 0, top - 1, withscores=True))
        beats = cast(list[tuple[str, float]], client.zrange(keys.executors, 0, -1, withscores=True))
        executors = []
        for executor_id, beat in beats:
            record = cast(dict[str, str], client.hgetall(keys.executor(executor_id)))
            load = json.loads(record.get("load", "{}"))
            executors.append(
                {
                    "id": executor_id,
                    "address": record.get("address", ""),
                    "model": record.get("model", ""),
                    # None: it stopped cleanly and waits for a scheduler to reap it (score 0).
                    "heartbeat_age_ms": round(now - beat) if beat > 0 else None,
                    "running": client.scard(keys.running(executor_id)),
                    "lease": client.get(keys.lease(executor_id)) or "",
                    "load": load,
                    "max_batch_size": int(record.get("max_batch_size") or 0),
                    "kv_used_pct": kv_percent(load, record),
                    # The executor's own prefix-cache hit rate, and how many of its blocks the
                    # fleet's index (what placement goes by) holds.
                    "prefix_hit_pct": prefix_hit_percent(load),
                    "prefix_index_blocks": client.scard(keys.cached_blocks(executor_id)),
                }
            )
        return {
            "collected_ms": round(now),
            "queue_length": client.zcard(keys.pending),
            "queue_head": [{"id": rid, "score": score} for rid, score in queued],
            **sample_queue(client, keys.pending, keys.request, now, queue_sample),
            "executors": executors,
            **scan_requests(client, keys.request("*"), scan_limit),
            **scheduling_state(client, keys),
        }
    finally:
        client.close()


def inspect(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    try:
        return _inspect(args)
    except RedisError as exc:  # an operator's typo or an outage: say which, not a traceback
        print(f"baton inspect: cannot read Redis at {args.redis_url}: {exc}", file=sys.stderr)
        return 1


def _inspect(args: argparse.Namespace) -> int:
    if getattr(args, "watch", False):
        from baton.inspect_view import watch

        def collect() -> dict[str, Any]:
            return collect_inspection(args.redis_url, args.prefix, args.top)

        return watch(collect, interval=args.interval, iterations=args.iterations)
    from baton.inspect_view import format_age, sample_note, tenant_label

    snapshot = collect_inspection(args.redis_url, args.prefix, args.top)
    if args.json:
        print(json.dumps(snapshot, indent=2))
        return 0
    note = sample_note(snapshot)
    print(f"pending queue: {snapshot['queue_length']} requests")
    for item in snapshot["queue_head"]:
        print(f"  {item['id']}  score {item['score']:.0f}")
    by_priority = ", ".join(f"{p}: {n}" for p, n in snapshot["depth_by_priority"].items()) or "none"
    by_tenant = ", ".join(f"{tenant_label(t)}: {n}" for t, n in snapshot["depth_by_tenant"].items()) or "none"
    print(f"  by priority{note}: {by_priority}")
    print(f"  by tenant{note}: {by_tenant}")
    if oldest := snapshot["oldest_waiting"]:
        print(f"  oldest waiting: {oldest['id']} for {format_age(oldest['age_ms'])}")
    print(f"executors: {len(snapshot['executors'])}")
    print(
        f"  {'id':<20} {'address':<24} {'running':>7} {'kv used/total':>14} {'kv %':>6} {'hit %':>6} {'indexed':>8}"
        f" {'step ms':>8} {'beat ms':>8}  lease"
    )
    for ex in snapshot["executors"]:
        load = ex["load"]
        kv = f"{load.get('kv_blocks_used', 0)}/{load.get('kv_blocks_total', 0)}"
        pct = "-" if ex["kv_used_pct"] is None else f"{ex['kv_used_pct']:.1f}"
        hit = "-" if ex["prefix_hit_pct"] is None else f"{ex['prefix_hit_pct']:.1f}"
        step = f"{load.get('step_time_ms', 0.0):.1f}"
        beat = "stopped" if ex["heartbeat_age_ms"] is None else ex["heartbeat_age_ms"]
        print(
            f"  {ex['id']:<20} {ex['address']:<24} {ex['running']:>7} {kv:>14} {pct:>6} {hit:>6}"
            f" {ex['prefix_index_blocks']:>8} {step:>8} {beat:>8}  {ex['lease']}"
        )
    states = ", ".join(f"{k} {v}" for k, v in sorted(snapshot["requests_by_state"].items())) or "none"
    print(f"requests by state: {states}")
    print(f"tokens total: {snapshot['tokens_total']}, finished total: {snapshot['finished_total']}")
    print("tenants (virtual token counter, waiting, running):")
    for tenant, row in snapshot["tenants"].items():
        print(f"  {tenant_label(tenant):<20} {row['counter']:>12.1f} {row['waiting']:>8} {row['running']:>8}")
    print("output-length estimator (tenant|prompt bucket: samples, mean tokens, mean abs error):")
    for key, row in snapshot["estimator"].items():
        print(f"  {key:<24} {row['samples']:>6} {row['mean']:>8.1f} {row['abs_error']:>8.1f}")
    return 0
