"""The KV cache's block allocator: which fixed-size blocks each sequence owns. Pure bookkeeping, no tensors.

Why the allocator tries to keep a table contiguous: on CPU, attention reads a request's keys
straight out of the pool when its blocks are consecutive (a view), instead of gathering a
padded copy of every request's context in every layer, which costs more than the attention
itself. Blocks stay the unit of accounting; contiguity is only a placement preference.

Prefix caching (as vLLM's and nano-vllm's block managers): a full, computed block may be given a
name (``common/block_hashing.py``: a hash of every token up to its end). Blocks are counted by
reference, so tables whose sequences share a prefix share its named blocks; a named block nobody
references stays cached, its K/V intact, until its room is needed. Cached blocks count as free
(they are reclaimable at once), so admission and scheduling arithmetic ignore the cache; they are
reclaimed in least-recently-released order, and only once no plain free block is left. A shared
block is never written: only blocks wholly computed are named, and a sequence that takes them
starts computing after them.

A sliding-window model whose every layer is windowed lets go of a sequence's first blocks once no
later query reads them (``sliding_window.py``): ``release_front`` drops their references as
``release`` does and leaves ``placeholder`` in their place, so positions still index the table.
Each block is released once: both skip placeholders.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

# Block states. HELD blocks are free, but kept as room for the sequence placed just before
# them to grow into; anyone may take them once no plain free block is left. CACHED blocks are
# free too, but keep a name and the K/V behind it until they are taken (evicted).
_FREE, _USED, _HELD, _CACHED = 0, 1, 2, 3


class OutOfBlocks(RuntimeError):
    """No free KV block is left; the engine preempts someone and retries."""


class BlockAllocator:
    """Hands out fixed-size KV blocks. Pure bookkeeping, no tensors."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Off: nothing is ever named, so nothing is cached and every release frees its blocks.
        self.prefix_caching = prefix_caching
        self._state = bytearray(num_blocks)  # one byte per block: bytes.find locates runs in C
        self._refs = [0] * num_blocks  # tables holding each block
        self._num_free = num_blocks
        # First block of a table -> the blocks held for it, and the table (its id) they are held for:
        # another table starting with the same blocks (one that took them while this one runs)
        # must not grow into them.
        self._rooms: dict[int, tuple[range, int]] = {}
        self._name_of: dict[int, int] = {}  # named block -> its name
        self._block_of: dict[int, int] = {}  # name -> the block holding it
        # Unreferenced named blocks, oldest release first: the order they are evicted in.
        self._lru: dict[int, None] = {}
        # Names stored (True) or evicted (False) since the last drain, the latest change per name.
        self._changes: dict[int, bool] = {}

    @property
    def placeholder(self) -> int:
        """What a released block leaves in its table: an id the allocator never hands out (the KV
        pool's scratch block, so an index through it stays in bounds), which no read path reads."""
        return self.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks nobody references: plain free, held as room, or cached (reclaimable)."""
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_cached(self) -> int:
        """Named blocks nobody references: free, but their K/V may still be reused."""
        return len(self._lru)

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
            start = self._place(missing, max(missing, self.blocks_for(final_tokens)), id(block_table))
            if start is not None:
                block_table.extend(self._take(b) for b in range(start, start + missing))
                return
        state = self._state
        # Grow in place into plain free blocks, or into the room held for this very table: not into
        # room held for another, such as the running sequence whose blocks this table started from.
        room, owner = self._rooms.get(block_table[0], (range(0), 0)) if block_table else (range(0), 0)
        own_room = room if owner == id(block_table) else range(0)
        for taken in range(missing):
            after = block_table[-1] + 1 if block_table else self.num_blocks
            if after < self.num_blocks and (state[after] == _FREE or (state[after] == _HELD and after in own_room)):
                block_table.append(self._take(after))
            elif self._num_free > len(self._lru):
                block_table.append(self._take(self._any_free()))
            else:
                # Only cached blocks are left: evict the least recently released ones, in
                # ascending order, so a table released whole and reclaimed whole stays a run.
                block_table.extend(self._take(b) for b in sorted(islice(self._lru, missing - taken)))
                return

    def release(self, block_table: list[int], names: Sequence[int] = ()) -> None:
        """Drop a sequence's references to its blocks and empty its table. Blocks nobody references
        become free, or cached when named; the table's tail is released first, so evicted first
        (a long prefix is less likely to be asked for again than its start).

        ``names``: the sequence's block names. Blocks its window released early (``placeholder``
        in the table) went to the cache then, before the rest, and would be evicted first; a
        prefix is found from its first block on, so that would strand every later block of it.
        Those still cached are counted released now, after the rest, the first last."""
        if not block_table:
            return
        placeholder = self.placeholder
        released_early = []
        if block_table[0] != placeholder:
            self._drop_room(block_table[0])
        elif names:  # its window released its front: placeholders run from the start
            released_early = [names[i] for i, block in enumerate(block_table[: len(names)]) if block == placeholder]
        for block in reversed(block_table):
            if block != placeholder:
                self._unref(block)
        block_table.clear()
        for name in reversed(released_early):
            cached = self._block_of.get(name)
            if cached is not None and cached in self._lru:
                del self._lru[cached]
                self._lru[cached] = None

    def release_front(self, block_table: list[int], count: int) -> None:
        """Release the first ``count`` blocks of a table (those not released already) and leave
        ``placeholder`` in their place; the rest of the table is untouched. Released back to front,
        as ``release`` does."""
        placeholder = self.placeholder
        for index in range(min(count, len(block_table)) - 1, -1, -1):
            block = block_table[index]
            if block == placeholder:
                break  # released before, and so is everything ahead of it
            if index == 0:
                self._drop_room(block)
            self._unref(block)
            block_table[index] = placeholder

    def _drop_room(self, first: int) -> None:
        """The table starting at block ``first`` lets go of it: when it is the last to hold it, the
        room held after it is free for anyone."""
        if self._refs[first] == 1:
            state = self._state
            for block in self._rooms.pop(first, (range(0), 0))[0]:
                if state[block] == _HELD:
                    state[block] = _FREE

    def _unref(self, block: int) -> None:
        """One table fewer holds ``block``: nobody left makes it free, or cached when named."""
        refs = self._refs
        refs[block] -= 1
        if refs[block]:
            return
        self._num_free += 1
        if block in self._name_of:
            self._state[block] = _CACHED
            self._lru[block] = None
        else:
            self._state[block] = _FREE

    # ---- prefix cache ------------------------------------------------------------------
    def cached_prefix(self, names: Sequence[int]) -> list[int]:
        """Take the blocks of the longest run of ``names`` held here, from the first (one more
        reference each), and return them in order; empty when the first is not held."""
        blocks: list[int] = []
        for name in names:
            block = self._block_of.get(name)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._lru[block]
                self._state[block] = _USED
                self._num_free -= 1
            self._refs[block] += 1
            blocks.append(block)
        return blocks

    def add_reference(self, block: int) -> None:
        """One more table holds ``block``, which is in use: a sequence starting from a block that
        another fills in the same step, before it has a name to be found by."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not in use, so it cannot be shared")
        self._refs[block] += 1

    def name(self, block: int, name: int) -> None:
        """Register a full, computed ``block`` under ``name``. When another block already holds
        that name (two sequences computed the same prefix at once) the first keeps it and this
        block stays unnamed."""
        if not self.prefix_caching or name in self._block_of or block in self._name_of:
            return
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not in use, so it cannot be named")
        self._block_of[name] = block
        self._name_of[block] = name
        self._changes[name] = True

    def cached_names(self) -> tuple[int, ...]:
        """Every name held now, referenced or not."""
        return tuple(self._block_of)

    def drain_changes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Names stored and names evicted since the last drain (disjoint: the latest change wins)."""
        if not self._changes:
            return (), ()
        changes, self._changes = self._changes, {}
        stored = tuple(name for name, present in changes.items() if present)
        removed = tuple(name for name, present in changes.items() if not present)
        return stored, removed

    # ---- placement ---------------------------------------------------------------------
    def contiguous_start(self, block_table: Sequence[int]) -> int | None:
        """The first block when the table is one run of consecutive blocks, else None."""
        if not block_table:
            return None
        first = block_table[0]
        if block_table[-1] - first != len(block_table) - 1:
            return None
        return first if list(block_table) == list(range(first, first + len(block_table))) else None

    def _place(self, need: int, want: int, owner: int) -> int | None:
        """Start of ``need`` free blocks in a row, with room held after them up to ``want`` for the
        table whose id is ``owner``."""
        state = self._state
        for size in (want, need):
            start = state.find(bytes(size))
            if start >= 0:
                room = range(start + need, start + size)
                for block in room:
                    state[block] = _HELD
                if room:
                    self._rooms[start] = (room, owner)
                return start
        return None

    def _any_free(self) -> int:
        """A plain free block, else one held as room (the caller checked one of them is left)."""
        block = self._state.find(_FREE)
        return block if block >= 0 else self._state.find(_HELD)

    def _take(self, block: int) -> int:
        if self._state[block] == _CACHED:
            del self._lru[block]
            name = self._name_of.pop(block)
            del self._block_of[name]
            self._changes[name] = False
        self._state[block] = _USED
        self._refs[block] = 1
        self._num_free -= 1
        return block
