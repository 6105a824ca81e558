"""The paged attention's context reads: keys gathered by whole blocks are the keys their slots hold."""

from __future__ import annotations

import random

import pytest
import torch

from executor_service.paged_attention import ContextBlocks


@pytest.mark.parametrize(("start", "end"), [(0, 1), (0, 16), (3, 40), (16, 33), (15, 64), (31, 32)])
def test_context_blocks_gather_the_slots_of_a_scattered_table(start: int, end: int) -> None:
    block_size, kv_heads, dim = 16, 2, 8
    pool = torch.randn(12 * block_size, kv_heads, dim)
    table = random.Random(start * 100 + end).sample(range(12), 4)
    slots = [table[t // block_size] * block_size + t % block_size for t in range(start, end)]
    context = ContextBlocks(
        torch.tensor(table[start // block_size : (end - 1) // block_size + 1]), start % block_size, block_size
    )
    assert torch.equal(context.gather(pool, end - start), pool[torch.tensor(slots)])
