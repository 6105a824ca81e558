"""A sliding-window model served end to end beyond its KV pool: real redis-server, real executor and
scheduler gRPC servers, a generated Mistral whose every layer is windowed. The executor reports its
window in Info and the scheduler counts each request's blocks by it, so prompts longer than the
executor's whole pool are placed (by their whole length they could never be), run side by side
and give ``model.generate``'s tokens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from common.pb import generate_pb2 as pb
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.executor_service.test_sliding_window import WINDOW, windowed_model
from tests.stack import Stack, joined_tokens, stack_config, start_stack

BLOCK_SIZE, BUDGET = 16, 64
PROMPT_LEN, NEW_TOKENS = 280, 60  # the prompt alone needs 18 blocks


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return windowed_model(tmp_path_factory.mktemp("windowed-stack") / "mistral", "mistral")


@pytest.fixture
async def stack(redis_url: str, mistral_dir: Path) -> AsyncIterator[Stack]:
    # A pool of 1 MiB (16 blocks of 16 tokens) and steps of at most 64 tokens, on both sides.
    config = stack_config(
        redis_url,
        mistral_dir,
        executor={"kv_cache_memory_mb": 1, "block_size": BLOCK_SIZE, "token_budget": BUDGET},
        scheduler={
            "token_level": {"token_budget": BUDGET, "max_prefill_chunk": BUDGET},
            "batch_level": {"max_batch_size": 8},
        },
    )
    running = await start_stack(config)
    yield running
    await running.stop()


async def test_requests_longer_than_the_pool_complete_exactly(stack: Stack, mistral_dir: Path) -> None:
    allocator = stack.executors[0].loaded.engine.allocator
    assert allocator.num_blocks * allocator.block_size < PROMPT_LEN, "the pool would hold the prompt whole"
    (link,) = stack.scheduler.dispatcher.links.values()
    assert link.info is not None and link.info.kv_window_tokens == WINDOW  # what Info said over gRPC
    # Each request holds the blocks its window and one chunk reach (79 tokens: 6 blocks), so two run
    # at once in the 15 blocks the watermark leaves, and the third waits for room.
    assert link.capacity().request_kv_blocks(PROMPT_LEN) == 6
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(5, 8000) for _ in range(PROMPT_LEN - 1)] for _ in range(3)]
    requests = [
        pb.GenerateRequest(prompt_token_ids=p, params=pb.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        for p in prompts
    ]
    results = await asyncio.gather(*(stack.generate(r) for r in requests))
    reference_model = load_reference_model(mistral_dir)
    for i, (prompt, chunks) in enumerate(zip(prompts, results, strict=True)):
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH, chunks[-1]
        reference = reference_greedy(reference_model, prompt, NEW_TOKENS)
        assert_matches_reference(joined_tokens(chunks), reference, f"prompt {i}")
