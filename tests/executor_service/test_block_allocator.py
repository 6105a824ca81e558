"""The block allocator: exact accounting, contiguous placement whenever there is room for it, and the
prefix cache (reference counts, LRU eviction, names and their events)."""

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


# ---- prefix cache ----------------------------------------------------------------------


def filled(alloc: BlockAllocator, names: list[int]) -> list[int]:
    """A table of ``len(names)`` full blocks, each named, as a sequence that computed them leaves it."""
    table: list[int] = []
    alloc.grow(table, len(names) * alloc.block_size)
    for block, name in zip(table, names, strict=True):
        alloc.name(block, name)
    return table


def test_a_released_named_block_stays_cached_and_counts_as_free() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    table = filled(alloc, [11, 12, 13])
    blocks = list(table)
    alloc.release(table)
    assert alloc.num_free == 8 and alloc.num_used == 0 and alloc.num_cached == 3
    assert alloc.drain_changes() == ((11, 12, 13), ())
    again = alloc.cached_prefix([11, 12, 99, 13])  # the run stops at the first unknown name
    assert again == blocks[:2] and alloc.num_free == 6 and alloc.num_cached == 1


def test_shared_blocks_are_counted_and_freed_only_by_their_last_table() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    a = filled(alloc, [1, 2])
    b = alloc.cached_prefix([1, 2])  # a running sequence's blocks are shared while it runs
    assert b == a and alloc.num_used == 2
    alloc.grow(b, 10)  # b grows past the shared prefix into a block of its own
    assert alloc.num_used == 3 and b[:2] == a
    alloc.release(a)
    assert alloc.num_used == 3 and alloc.num_cached == 0  # still referenced by b: not freed
    alloc.grow([], 4 * 5)  # 5 blocks: every other block, and no shared one is taken
    assert alloc.num_free == 0
    with pytest.raises(OutOfBlocks):
        alloc.grow([], 1)


def test_a_block_shared_before_it_is_named_is_freed_by_its_last_table_and_cached_once_named() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    filler: list[int] = []
    alloc.grow(filler, 8)
    follower = list(filler)  # starts from the blocks its filler fills in the same step
    first = follower[0]
    for block in follower:
        alloc.add_reference(block)
    assert alloc.num_used == 2
    alloc.release(filler)
    assert alloc.num_used == 2  # the follower still reads them
    alloc.name(first, 11)  # named after the step, by whichever of the two names it first
    alloc.release(follower)
    assert alloc.num_free == 4 and alloc.num_cached == 1
    assert alloc.cached_prefix([11]) == [first]
    with pytest.raises(ValueError, match="not in use"):
        alloc.add_reference(3)


def test_a_table_sharing_a_running_tables_blocks_grows_outside_its_room() -> None:
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    filler: list[int] = []
    alloc.grow(filler, 8, final_tokens=24)  # blocks 0-1, and 2-5 held as its room
    follower = list(filler)
    for block in follower:
        alloc.add_reference(block)
    alloc.grow(follower, 12)
    assert follower[2] not in range(2, 6)
    alloc.grow(filler, 24)
    assert alloc.contiguous_start(filler) == 0  # its prefill still reads its context as a view
    alloc.release(filler)
    alloc.grow(follower, 16)  # the room's last holder is gone: it is anyone's again
    assert alloc.num_used == 4


def test_eviction_takes_plain_free_blocks_first_then_the_least_recently_released_tail_first() -> None:
    alloc = BlockAllocator(num_blocks=6, block_size=1)
    old = filled(alloc, [1, 2])  # blocks 0, 1
    new = filled(alloc, [3, 4])  # blocks 2, 3
    old_blocks, new_blocks = list(old), list(new)
    alloc.release(old)
    alloc.release(new)
    alloc.drain_changes()
    table: list[int] = []
    alloc.grow(table, 2)  # the two plain free blocks, no eviction
    assert sorted(table) == [4, 5] and alloc.num_cached == 4
    assert alloc.drain_changes() == ((), ())
    one: list[int] = []
    alloc.grow(one, 1)  # the oldest release's tail goes first
    assert one == [old_blocks[1]] and alloc.drain_changes() == ((), (2,))
    assert alloc.cached_prefix([1, 2]) == [old_blocks[0]]  # its head is still there
    assert alloc.cached_prefix([3, 4]) == new_blocks


def test_reclaiming_only_cached_blocks_keeps_a_table_contiguous() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=1)
    alloc.release(filled(alloc, [1, 2, 3, 4]))  # released tail first: 3, 2, 1, 0 in eviction order
    alloc.drain_changes()
    table: list[int] = []
    alloc.grow(table, 4, final_tokens=4)
    assert table == [0, 1, 2, 3] and alloc.contiguous_start(table) == 0
    assert alloc.drain_changes() == ((), (1, 2, 3, 4)) and alloc.num_cached == 0


def test_the_first_registration_of_a_name_wins() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    a: list[int] = []
    b: list[int] = []
    alloc.grow(a, 2)
    alloc.grow(b, 2)
    alloc.name(a[0], 7)
    alloc.name(b[0], 7)  # the same prefix computed twice at once: b's copy stays unnamed
    assert alloc.drain_changes() == ((7,), ())
    alloc.release(b)
    assert alloc.num_cached == 0 and alloc.num_free == 3  # plain free
    alloc.release(a)
    assert alloc.num_cached == 1 and alloc.cached_names() == (7,)
    with pytest.raises(ValueError):
        alloc.name(3, 8)  # a block nobody holds cannot be named


def test_events_report_the_latest_change_per_name() -> None:
    alloc = BlockAllocator(num_blocks=1, block_size=1)
    alloc.release(filled(alloc, [5]))
    plain: list[int] = []
    alloc.grow(plain, 1)  # evicts 5
    assert alloc.drain_changes() == ((), (5,))
    alloc.release(plain)
    alloc.release(filled(alloc, [6]))
    alloc.release(filled(alloc, [5]))  # 6 evicted, 5 back: only the net change is reported
    assert alloc.drain_changes() == ((5,), (6,))


def test_prefix_caching_off_names_nothing() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=2, prefix_caching=False)
    table = filled(alloc, [1, 2])
    alloc.release(table)
    assert alloc.num_cached == 0 and alloc.cached_prefix([1]) == [] and alloc.drain_changes() == ((), ())


def test_a_room_stays_while_any_table_starting_at_its_block_lives() -> None:
    alloc = BlockAllocator(num_blocks=16, block_size=2)
    a: list[int] = []
    alloc.grow(a, 4, final_tokens=20)  # blocks 0-1 and room 2-9 held
    alloc.name(a[0], 1)
    b = alloc.cached_prefix([1])
    alloc.release(b)  # a still starts at block 0: its room stays
    alloc.grow(a, 20)
    assert alloc.contiguous_start(a) == 0
    alloc.release(a)
    c: list[int] = []
    alloc.grow(c, 32)  # the whole pool, the cached block evicted last
    assert alloc.num_free == 0


def test_random_churn_with_sharing_never_frees_a_referenced_block_and_leaks_nothing() -> None:
    rng = random.Random(3)
    alloc = BlockAllocator(num_blocks=60, block_size=2)
    tables: list[tuple[list[int], list[int]]] = []  # (table, the names of its named blocks)
    for _ in range(3000):
        roll = rng.random()
        if tables and roll < 0.3:
            table, _names = tables.pop(rng.randrange(len(tables)))
            alloc.release(table)
        elif tables and roll < 0.6:
            table, names = rng.choice(tables)
            with contextlib.suppress(OutOfBlocks):
                alloc.grow(table, len(table) * 2 + rng.randrange(1, 5), final_tokens=rng.randrange(0, 60))
            while len(names) < len(table) - 1:  # all but the last block are full and computed
                name = hash((names[-1] if names else 0, rng.randrange(3)))  # few distinct prefixes
                alloc.name(table[len(names)], name)
                names.append(name)
        else:
            names = [hash((0, rng.randrange(3)))]
            for _ in range(rng.randrange(4)):
                names.append(hash((names[-1], rng.randrange(3))))
            table = alloc.cached_prefix(names)
            names = names[: len(table)]
            try:
                alloc.grow(table, len(table) * 2 + rng.randrange(1, 9), final_tokens=rng.randrange(0, 60))
                tables.append((table, names))
            except OutOfBlocks:
                alloc.release(table)
        counts: dict[int, int] = {}
        for table, _names in tables:
            for block in table:
                counts[block] = counts.get(block, 0) + 1
        assert alloc.num_used == len(counts)
        assert all(alloc._refs[b] == n for b, n in counts.items())  # every reference accounted
        assert all(alloc._state[b] == 1 for b in counts)  # nothing referenced is free
    for table, _names in tables:
        alloc.release(table)
    assert alloc.num_free == alloc.num_blocks and alloc.num_used == 0


def test_release_front_leaves_placeholders_and_frees_each_block_once() -> None:
    alloc = BlockAllocator(num_blocks=16, block_size=2)
    table: list[int] = []
    alloc.grow(table, 10, final_tokens=20)  # blocks 0-4, room 5-9 held
    alloc.name(table[0], 1)
    alloc.release_front(table, 2)
    hole = alloc.placeholder
    assert hole == 16 and table == [hole, hole, 2, 3, 4]
    assert alloc.num_used == 3 and alloc.num_cached == 1  # the named block stays cached
    alloc.release_front(table, 3)  # the first two are released already: only block 2 goes
    assert table == [hole, hole, hole, 3, 4] and alloc.num_used == 2
    alloc.grow(table, 12)  # positions still index the table; growth stays in the run
    assert table[-1] == 5 and alloc.num_used == 3
    alloc.release(table)
    assert table == [] and alloc.num_used == 0 and alloc.num_free == 16
    whole: list[int] = []
    alloc.grow(whole, 32)  # nothing leaked, nothing freed twice: the whole pool again
    assert alloc.num_free == 0 and alloc.num_cached == 0


def test_blocks_a_window_released_early_are_evicted_last_once_their_table_is_released() -> None:
    # A windowed sequence let go of its first two blocks before the rest: released with their names,
    # they count as released after the rest, so eviction takes the chain from its tail, not its head.
    alloc = BlockAllocator(num_blocks=4, block_size=1)
    chain = filled(alloc, [1, 2, 3, 4])
    blocks = list(chain)
    alloc.release_front(chain, 2)
    alloc.release(chain, names=[1, 2, 3, 4])
    evicted: list[int] = []
    alloc.grow(evicted, 2)
    assert sorted(evicted) == sorted(blocks[2:])
    assert alloc.cached_prefix([1, 2, 3, 4]) == blocks[:2]  # its start is still found


def test_release_front_of_a_shared_block_keeps_it_for_the_other_table() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=1)
    a: list[int] = []
    alloc.grow(a, 3, final_tokens=6)  # blocks 0-2, room 3-5
    alloc.name(a[0], 7)
    b = alloc.cached_prefix([7])  # b shares block 0
    alloc.release_front(a, 1)
    assert a[0] == alloc.placeholder and b == [0] and alloc._refs[0] == 1
    assert alloc._rooms  # b still starts at block 0: the room stays
    alloc.release_front(b, 1)
    assert alloc._refs[0] == 0 and alloc.num_cached == 1 and not alloc._rooms  # the last one took the room
    alloc.release(a)
    alloc.release(b)
    assert alloc.num_used == 0 and alloc.num_free == 8


def test_random_churn_with_released_fronts_leaks_nothing() -> None:
    rng = random.Random(5)
    alloc = BlockAllocator(num_blocks=40, block_size=2)
    tables: list[list[int]] = []
    for _ in range(3000):
        roll = rng.random()
        if tables and roll < 0.2:
            alloc.release(tables.pop(rng.randrange(len(tables))))
        elif tables and roll < 0.5:
            table = rng.choice(tables)
            alloc.release_front(table, rng.randrange(len(table) + 1))
        elif tables and roll < 0.8:
            with contextlib.suppress(OutOfBlocks):
                alloc.grow(rng.choice(tables), rng.randrange(1, 80), final_tokens=rng.randrange(0, 80))
        else:
            new: list[int] = []
            with contextlib.suppress(OutOfBlocks):
                alloc.grow(new, rng.randrange(1, 20), final_tokens=rng.randrange(0, 80))
                tables.append(new)
        held = [block for table in tables for block in table if block != alloc.placeholder]
        assert len(held) == len(set(held)) == alloc.num_used
        assert all(alloc._refs[b] == 1 for b in held)
    for table in tables:
        alloc.release(table)
    assert alloc.num_free == alloc.num_blocks and alloc.num_used == 0
