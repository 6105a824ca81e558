"""The paged KV cache: the per-layer K/V tensors, indexed by token slot.

Every layer's keys and values live in one flat tensor of ``num_blocks * block_size`` token
slots. A sequence owns a list of blocks (its block table); token ``t`` of the sequence lives
in slot ``block_table[t // block_size] * block_size + t % block_size``. Memory is allocated
once at start, sized from a memory setting, so the executor never grows past it. Which blocks
each sequence owns is ``executor_service.block_allocator``'s bookkeeping.

One block more than the allocator hands out is the scratch block: the padded rows of a
static-shape decode step (``decode_step.py``) write their K/V there and read it back, so padding
never touches a request's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one token's K/V in one layer, and how many layers there are."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def num_blocks_for(self, memory_bytes: int, block_size: int) -> int:
        blocks = memory_bytes // (self.bytes_per_token * block_size)
        if blocks < 1:
            raise ValueError(f"{memory_bytes} bytes cannot hold one KV block of {block_size} tokens")
        return int(blocks)


class KVPool:
    """The K/V tensors of every layer, indexed by flat token slot."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int, device: torch.device) -> None:
        slots = (num_blocks + 1) * block_size  # the allocator's blocks, then the scratch block
        shape = (geometry.num_layers, slots, geometry.num_kv_heads, geometry.head_dim)
        self.keys = torch.zeros(shape, dtype=geometry.dtype, device=device)
        self.values = torch.zeros(shape, dtype=geometry.dtype, device=device)
        self.block_size = block_size
        self.scratch_block = num_blocks  # never handed out by the allocator, which has num_blocks

    def slots(self, block_table: Sequence[int], start: int, end: int) -> list[int]:
        """Flat slots of tokens ``start..end-1`` of a sequence with this block table."""
        size = self.block_size
        return [block_table[t // size] * size + t % size for t in range(start, end)]
