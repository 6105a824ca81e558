"""Two executors with prefix caching, end to end: a prompt that repeats a cached prefix goes to the
executor that holds it, its prefill is skipped there (read from each executor's /metrics), and
its output still equals ``model.generate`` on the prompt alone."""

from __future__ import annotations

import random
import urllib.request
from pathlib import Path

from baton.dev import free_port
from common.metrics import serve_metrics
from common.pb import generate_pb2 as pb
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.scheduler_service.test_end_to_end import greedy
from tests.stack import Stack, eventually, joined_tokens, stack_config, start_stack

SYSTEM_LEN = 80  # five full blocks of 16
OUTPUT = 12


def _counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


async def test_repeats_of_a_cached_prefix_go_to_its_executor_and_skip_its_prefill(
    redis_url: str, tiny_model_dir: Path
) -> None:
    rng = random.Random(27)
    systems = [[1] + [rng.randrange(5, 8000) for _ in range(SYSTEM_LEN - 1)] for _ in range(4)]
    stack = await start_stack(stack_config(redis_url, tiny_model_dir), executors=2)
    try:
        ports = [serve_metrics(ex.metrics.registry, free_port(), host="127.0.0.1") for ex in stack.executors]
        store = stack.scheduler.frontend.store
        holder: dict[int, str] = {}
        for g, system in enumerate(systems):  # each prefix's first request, one at a time
            request = greedy([*system, *(rng.randrange(5, 8000) for _ in range(8))], OUTPUT, request_id=f"first-{g}")
            await stack.generate(request)
            status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id=request.request_id))
            holder[g] = status.executor_id

            async def indexed(executor_id: str = status.executor_id) -> bool:
                return bool(await store.redis.scard(store.keys.cached_blocks(executor_id)))

            await eventually(indexed, f"the index of {status.executor_id} to hold prefix {g}")
        assert set(holder.values()) == {"exec-0", "exec-1"}, f"misses must spread over the executors: {holder}"

        repeats = []
        for r in range(3):
            for g, system in enumerate(systems):
                prompt = [*system, *(rng.randrange(5, 8000) for _ in range(rng.randrange(1, 20)))]
                request = greedy(prompt, OUTPUT, request_id=f"repeat-{g}-{r}")
                tokens = joined_tokens(await stack.generate(request))
                status = await stack.stub.GetRequest(pb.GetRequestRequest(request_id=request.request_id))
                assert status.executor_id == holder[g], f"{request.request_id} went to {status.executor_id}"
                repeats.append((prompt, tokens))

        reference_model = load_reference_model(tiny_model_dir)
        for i, (prompt, tokens) in enumerate(repeats):
            assert_matches_reference(tokens, reference_greedy(reference_model, prompt, OUTPUT), f"repeat {i}")

        hits = queries = 0.0
        for port in ports:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            hits += _counter(text, "baton:prefix_cache_hits_total")
            queries += _counter(text, "baton:prefix_cache_queries_total")
        assert hits >= len(repeats) * SYSTEM_LEN, (hits, queries)
        assert queries > hits
    finally:
        await stack.stop()


async def test_a_prompt_scored_for_its_log_probabilities_names_no_blocks_for_placement(stack: Stack) -> None:
    """A request for its prompt's log probabilities computes its whole prompt, cache or not: its
    record names no blocks, so placement neither credits it a cached prefix nor sends requests that
    share its prompt after it, to blocks it never cached."""
    prompt = list(range(5, 5 + 3 * 16 + 5))
    plain = greedy(prompt, 2, request_id="plain")
    scored = greedy(prompt, 2, request_id="scored")
    scored.params.prompt_logprobs = 1
    for request in (plain, scored):
        await stack.stub.Complete(request)
    records = stack.scheduler.frontend.store.requests
    plain_record, scored_record = await records.get("plain"), await records.get("scored")
    assert plain_record is not None and scored_record is not None
    assert plain_record.get("prefix") and not scored_record.get("prefix")
