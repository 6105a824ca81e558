"""The paged KV cache: a block allocator (pure bookkeeping) and the per-layer K/V tensors.

Every layer's keys and values live in one flat tensor of ``num_blocks * block_size`` token
slots. A sequence owns a list of blocks (its block table); token ``t`` of the sequence lives
in slot ``block_table[t // block_size] * block_size + t % block_size``. Memory is allocated
once at start, sized from a memory setting, so the executor never grows past it.

Why the allocator tries to keep a table contiguous: on CPU, attention reads a request's keys
straight out of the pool when its blocks are consecutive (a view), instead of gathering a
padded copy of every request's context in every layer, which costs more than the attention
itself. Blocks stay the unit of accounting; contiguity is only a placement preference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Block states. HELD blocks are free, but kept as room for the sequence placed just before
# them to grow into; anyone may take them once no plain free block is left.
_FREE, _USED, _HELD = 0, 1, 2


class OutOfBlocks(RuntimeError):
    """No free KV block is left; the engine preempts someone and retries."""


class BlockAllocator:
    """Hands out fixed-size KV blocks. Pure bookkeeping, no tensors."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._state = bytearray(num_blocks)  # one byte per block: bytes.find locates runs in C
        self._num_free = num_blocks
        self._rooms: dict[int, range] = {}  # first block of a table -> the blocks held for it

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def grow(self, block_table: list[int], num_tokens: int, final_tokens: int = 0) -> None:
        """Extend ``block_table`` in place so it holds ``num_tokens`` tokens, or raise OutOfBlocks unchanged.

        ``final_tokens`` is how long the sequence may get: a new table is placed where that many
        tokens fit in a row, and the room after it is held, so later growth stays contiguous.
        """
        missing = self.blocks_for(num_tokens) - len(block_table)
        if missing <= 0:
            return
        if missing > self._num_free:
            raise OutOfBlocks(f"need {missing} blocks, {self._num_free} free")
        if not block_table:
            start = self._place(missing, max(missing, self.blocks_for(final_tokens)))
            if start is not None:
                block_table.extend(self._take(b) for b in range(start, start + missing))
                return
        for _ in range(missing):
            after = block_table[-1] + 1 if block_table else self.num_blocks
            if after < self.num_blocks and self._state[after] != _USED:
                block_table.append(self._take(after))
            else:
                block_table.append(self._take(self._any_free()))

    def release(self, block_table: list[int]) -> None:
        """Return a sequence's blocks to the pool and empty its table."""
        if block_table:
            for block in self._rooms.pop(block_table[0], range(0)):
                if self._state[block] == _HELD:
                    self._state[block] = _FREE
        for block in block_table:
            self._state[block] = _FREE
        self._num_free += len(block_table)
        block_table.clear()

    def contiguous_start(self, block_table: Sequence[int]) -> int | None:
        """The first block when the table is one run of consecutive blocks, else None."""
        if not block_table:
            return None
        first = block_table[0]
        if block_table[-1] - first != len(block_table) - 1:
            return None
        return first if list(block_table) == list(range(first, first + len(block_table))) else None

    def _place(self, need: int, want: int) -> int | None:
        """Start of ``need`` free blocks in a row, with room held after them up to ``want``."""
        state = self._state
        for size in (want, need):
            start = state.find(bytes(size))
            if start >= 0:
                room = range(start + need, start + size)
                for block in room:
                    state[block] = _HELD
                if room:
                    self._rooms[start] = room
                return start
        return None

    def _any_free(self) -> int:
        block = self._state.find(_FREE)
        return block if block >= 0 else self._state.find(_HELD)

    def _take(self, block: int) -> int:
        self._state[block] = _USED
        self._num_free -= 1
        return block


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
