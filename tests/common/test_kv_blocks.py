"""common.kv_blocks: the blocks a sequence holds, whole or bounded by a block-releasing window."""

from __future__ import annotations

from common.kv_blocks import blocks_for, most_blocks_held


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_without_a_window_a_sequence_holds_its_whole_length() -> None:
    assert most_blocks_held(1_000, 16) == most_blocks_held(1_000, 16, window=0, chunk=64) == 63


def test_a_window_bounds_what_a_long_sequence_holds() -> None:
    # A chunk of 64 and the 15 tokens before it, from anywhere inside a block: 6 blocks of 16.
    assert most_blocks_held(1_000, 16, window=16, chunk=64) == 6
    assert most_blocks_held(100_000, 16, window=16, chunk=64) == 6
    # One token a step: the window's 16 tokens lie in at most 2 blocks, and the next token's.
    assert most_blocks_held(1_000, 8, window=16, chunk=1) == 3
    assert most_blocks_held(1_000, 8, window=16, chunk=0) == 3  # a chunk is at least one token
    # Shorter than the bound: its whole length.
    assert most_blocks_held(30, 16, window=16, chunk=64) == 2
