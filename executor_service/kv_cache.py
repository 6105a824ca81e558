"""The paged KV cache: a block allocator (pure bookkeeping) and the per-layer K/V tensors.

Every layer's keys and values live in one flat tensor of ``num_blocks * block_size`` token
slots. A sequence owns a list of blocks (its block table); token ``t`` of the sequence lives
in slot ``block_table[t // block_size] * block_size + t % block_size``. Memory is allocated
once at start, sized from a memory setting, so the executor never grows past it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class OutOfBlocks(RuntimeError):
    """No free KV block is left; the engine preempts someone and retries."""


class BlockAllocator:
    """Hands out fixed-size KV blocks. Pure bookkeeping, no tensors."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend ``block_table`` in place so it holds ``num_tokens`` tokens, or raise OutOfBlocks unchanged."""
        missing = self.blocks_for(num_tokens) - len(block_table)
        if missing <= 0:
            return
        if missing > len(self._free):
            raise OutOfBlocks(f"need {missing} blocks, {len(self._free)} free")
        block_table.extend(self._free.popleft() for _ in range(missing))

    def release(self, block_table: list[int]) -> None:
        """Return a sequence's blocks to the pool and empty its table."""
        self._free.extend(block_table)
        block_table.clear()


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
        slots = num_blocks * block_size
        shape = (geometry.num_layers, slots, geometry.num_kv_heads, geometry.head_dim)
        self.keys = torch.zeros(shape, dtype=geometry.dtype, device=device)
        self.values = torch.zeros(shape, dtype=geometry.dtype, device=device)
        self.block_size = block_size

    def slots(self, block_table: Sequence[int], start: int, end: int) -> list[int]:
        """Flat slots of tokens ``start..end-1`` of a sequence with this block table."""
        size = self.block_size
        return [block_table[t // size] * size + t % size for t in range(start, end)]
