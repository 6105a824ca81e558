"""What structured output costs: one JSON-schema workload, constrained and unconstrained, alternated.

One local stack (redis-server, an executor and a scheduler as separate processes, on the generated
tiny model by default), driven by concurrent gRPC ``Complete`` calls:

1. **Constrained (A).** ``--requests`` prompts, all at once, each with the same JSON schema (an
   order of ``--items`` line items), greedy. Every output must parse and validate, or the run fails.
2. **Unconstrained (B).** The same prompts without the schema, each with ``max_tokens`` set to the
   length its constrained output had and ``ignore_eos``: the same tokens to generate, request by
   request, so the two differ only by the grammar's work (compiling is done by a warm-up run).

A and B alternate ``--pairs`` times on the one stack, so drift in the machine's load hits both
alike. It prints each run's output tokens per second and the ratio of the medians, A over B:
constrained throughput as a share of unconstrained.

    python -m bench.structured_output --requests 32 --pairs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import jsonschema

from baton.bench.local_stack import ensure_model, local_stack
from common.pb import generate_pb2 as pb
from common.pb.generate_pb2_grpc import GenerationStub


def order_schema(items: int) -> dict[str, Any]:
    """An order of exactly ``items`` line items: bounded strings, integers, an enum and booleans."""
    line = {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "minLength": 4, "maxLength": 8},
            "qty": {"type": "integer", "minimum": 1, "maximum": 999},
            "unit": {"enum": ["each", "box", "kg"]},
            "gift": {"type": "boolean"},
        },
        "required": ["sku", "qty", "unit", "gift"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "customer": {"type": "string", "minLength": 3, "maxLength": 12},
            "lines": {"type": "array", "items": line, "minItems": items, "maxItems": items},
            "express": {"type": "boolean"},
        },
        "required": ["customer", "lines", "express"],
        "additionalProperties": False,
    }


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, 8000) for _ in range(rng.randrange(16, 64))] for _ in range(count)]


async def run_pass(
    target: str, batch: list[list[int]], schema: str | None, lengths: list[int] | None, max_tokens: int
) -> tuple[float, list[pb.CompleteResponse]]:
    """Seconds for the whole batch, and its responses in order."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = GenerationStub(channel)

        def request(i: int, prompt: list[int]) -> pb.GenerateRequest:
            params = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            if schema is not None:
                params.structured_output.json_schema = schema
            if lengths is not None:
                params.max_tokens = lengths[i]
            return pb.GenerateRequest(prompt_token_ids=prompt, params=params)

        started = time.perf_counter()
        out = await asyncio.gather(*(stub.Complete(request(i, p)) for i, p in enumerate(batch)))
        return time.perf_counter() - started, list(out)


def check(responses: list[pb.CompleteResponse], schema: dict[str, Any]) -> list[int]:
    """The constrained outputs' lengths; every one must be complete, parse and validate."""
    for r in responses:
        if r.finish_reason != pb.FINISH_REASON_STOP:
            raise SystemExit(f"a constrained output did not finish (raise --max-tokens): {r.text[:80]!r}")
        jsonschema.validate(json.loads(r.text), schema)
    return [len(r.token_ids) for r in responses]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32, help="requests per run, sent at once (default 32)")
    parser.add_argument("--items", type=int, default=4, help="line items in each order (default 4)")
    parser.add_argument("--pairs", type=int, default=3, help="constrained/unconstrained runs, alternated (default 3)")
    parser.add_argument("--max-tokens", type=int, default=400, help="cap of each constrained output (default 400)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    parser.add_argument("--model", type=Path, help="model dir (default: the generated tiny model, made once)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "baton-bench")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = args.model or ensure_model(args.workdir)
    schema = order_schema(args.items)
    text = json.dumps(schema)
    batch = prompts(args.requests, args.seed)
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    with local_stack(model, args.workdir / "structured-output-logs") as stack:
        # Warm-up: compiles the grammar and learns each prompt's constrained length (greedy: the same every run).
        _, warm = asyncio.run(run_pass(stack.target, batch, text, None, args.max_tokens))
        lengths = check(warm, schema)
        tokens = sum(lengths)
        asyncio.run(run_pass(stack.target, batch, None, lengths, args.max_tokens))
        print(f"{args.requests} requests, {tokens} output tokens per run (mean {tokens / len(lengths):.0f})")
        for i in range(args.pairs):
            for name, spec in (("constrained", text), ("unconstrained", None)):
                seconds, out = asyncio.run(run_pass(stack.target, batch, spec, lengths, args.max_tokens))
                if spec is not None and check(out, schema) != lengths:
                    raise SystemExit("a constrained run's lengths changed between runs")
                rates[name].append(tokens / seconds)
                print(f"run {i + 1} {name:>13}: {seconds:6.2f} s, {tokens / seconds:8.1f} tokens/s", flush=True)
    ratio = statistics.median(rates["constrained"]) / statistics.median(rates["unconstrained"])
    print(f"structured output throughput ratio (constrained / unconstrained, medians): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
