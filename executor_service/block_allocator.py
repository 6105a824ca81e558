"""The KV cache's block allocator: which fixed-size blocks each sequence owns. Pure bookkeeping, no tensors.

Why the allocator tries to keep a table contiguous: on CPU, attention reads a request's keys
straight out of the pool when its blocks are consecutive (a view), instead of gathering a
padded copy of every request's context in every layer, which costs more than the attention
itself. Blocks stay the unit of accounting; contiguity is only a placement preference.
"""

from __future__ import annotations

from collections.abc import Sequence

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
