"""Client-side subcommands: generate (streams to the terminal), health, inspect."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from typing import Any

import grpc


def generate(args: argparse.Namespace) -> int:
    from common.pb import generate_pb2 as pb
    from common.pb import generate_pb2_grpc

    request = pb.GenerateRequest(
        prompt=args.prompt,
        params=pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos),
        priority=args.priority,
        tenant=args.tenant,
    )
    with grpc.insecure_channel(args.target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            for chunk in stub.Generate(request):
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

    with grpc.insecure_channel(args.target) as channel:
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


def collect_inspection(redis_url: str, prefix: str, top: int = 10, scan_limit: int = 100_000) -> dict[str, Any]:
    """A snapshot of Baton's Redis state: queue, executors with load, requests by state."""
    import redis

    from common.keys import KeySchema

    keys = KeySchema(prefix)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        now = time.time() * 1000
        queued = client.zrange(keys.pending, 0, top - 1, withscores=True)
        executors = []
        for executor_id, beat in client.zrange(keys.executors, 0, -1, withscores=True):
            record = client.hgetall(keys.executor(executor_id))
            executors.append(
                {
                    "id": executor_id,
                    "address": record.get("address", ""),
                    "model": record.get("model", ""),
                    "heartbeat_age_ms": round(now - beat),
                    "running": client.scard(keys.running(executor_id)),
                    "lease": client.get(keys.lease(executor_id)) or "",
                    "load": json.loads(record.get("load", "{}")),
                }
            )
        states: Counter[str] = Counter()
        pattern = keys.request("*")
        for scanned, key in enumerate(client.scan_iter(match=pattern, count=1000)):
            if scanned >= scan_limit:
                break
            if key.count(":") == pattern.count(":"):  # a request hash, not its tokens list
                states[client.hget(key, "state") or "?"] += 1
        return {
            "queue_length": client.zcard(keys.pending),
            "queue_head": [{"id": rid, "score": score} for rid, score in queued],
            "executors": executors,
            "requests_by_state": dict(states),
        }
    finally:
        client.close()


def inspect(args: argparse.Namespace) -> int:
    snapshot = collect_inspection(args.redis_url, args.prefix, args.top)
    if args.json:
        print(json.dumps(snapshot, indent=2))
        return 0
    print(f"pending queue: {snapshot['queue_length']} requests")
    for item in snapshot["queue_head"]:
        print(f"  {item['id']}  score {item['score']:.0f}")
    print(f"executors: {len(snapshot['executors'])}")
    print(f"  {'id':<20} {'address':<24} {'running':>7} {'kv used/total':>14} {'step ms':>8} {'beat ms':>8}  lease")
    for ex in snapshot["executors"]:
        load = ex["load"]
        kv = f"{load.get('kv_blocks_used', 0)}/{load.get('kv_blocks_total', 0)}"
        step = f"{load.get('step_time_ms', 0.0):.1f}"
        print(
            f"  {ex['id']:<20} {ex['address']:<24} {ex['running']:>7} {kv:>14} {step:>8} "
            f"{ex['heartbeat_age_ms']:>8}  {ex['lease']}"
        )
    states = ", ".join(f"{k} {v}" for k, v in sorted(snapshot["requests_by_state"].items())) or "none"
    print(f"requests by state: {states}")
    return 0
