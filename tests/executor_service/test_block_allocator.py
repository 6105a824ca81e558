"""The block allocator: exact accounting, and contiguous placement whenever there is room for it."""

from __future__ import annotations

import contextlib
import random

import pytest

from executor_service.block_allocator import BlockAllocator, OutOfBlocks


def test_a_new_table_gets_a_run_with_room_to_grow() -> None:
    alloc = BlockAllocator(num_blocks=64, block_size=4)
    a: list[int] = []
    b: list[int] = []
    alloc.grow(a, 8, final_tokens=40)  # 2 blocks now, 10 at most
    alloc.grow(b, 8, final_tokens=40)
    assert b[0] >= a[0] + 10  # b is placed beyond a's room, so a grows in place
    for tokens in range(9, 41):
        alloc.grow(a, tokens)
        alloc.grow(b, tokens)
    assert alloc.contiguous_start(a) == a[0] and alloc.contiguous_start(b) == b[0]
    assert alloc.num_used == 20


def test_held_room_is_used_when_nothing_else_is_free() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=1)
    a: list[int] = []
    alloc.grow(a, 2, final_tokens=8)  # holds all 6 other blocks as room
    b: list[int] = []
    alloc.grow(b, 6)
    assert alloc.num_free == 0 and sorted(a + b) == list(range(8))
    with pytest.raises(OutOfBlocks):
        alloc.grow(a, 3)
    assert len(a) == 2  # unchanged after OutOfBlocks


def test_release_returns_blocks_and_room() -> None:
    alloc = BlockAllocator(num_blocks=16, block_size=2)
    a: list[int] = []
    alloc.grow(a, 4, final_tokens=32)
    alloc.release(a)
    assert a == [] and alloc.num_free == 16
    c: list[int] = []
    alloc.grow(c, 32)  # the whole pool in one run again
    assert alloc.contiguous_start(c) == 0


def test_contiguous_start_needs_consecutive_order() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=1)
    assert alloc.contiguous_start([]) is None
    assert alloc.contiguous_start([3, 4, 5]) == 3
    assert alloc.contiguous_start([2, 4, 3, 5]) is None  # right span, wrong order
    assert alloc.contiguous_start([5, 7]) is None


def test_random_churn_keeps_exact_accounting() -> None:
    rng = random.Random(0)
    alloc = BlockAllocator(num_blocks=100, block_size=4)
    tables: list[list[int]] = []
    for _ in range(2000):
        if tables and rng.random() < 0.3:
            alloc.release(tables.pop(rng.randrange(len(tables))))
        elif tables and rng.random() < 0.6:
            table = rng.choice(tables)
            with contextlib.suppress(OutOfBlocks):
                alloc.grow(table, len(table) * 4 + rng.randrange(1, 9), final_tokens=rng.randrange(0, 200))
        else:
            table = []
            try:
                alloc.grow(table, rng.randrange(1, 40), final_tokens=rng.randrange(0, 200))
                tables.append(table)
            except OutOfBlocks:
                pass
        owned = [b for t in tables for b in t]
        assert len(owned) == len(set(owned)) == alloc.num_used
