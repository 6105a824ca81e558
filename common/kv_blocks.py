"""How many KV blocks a sequence holds: the one rule the executor admits a request by and the
scheduler service places it and counts its executors' committed blocks by, so the two never disagree.

A sequence holds a block for every ``block_size`` of its tokens, unless every layer of the model
attends within a sliding window. Then the executor releases each block the window has passed
(``executor_service/sliding_window.py``), and a sequence computed in chunks of at most ``chunk``
tokens holds only the blocks one chunk's keys reach: the chunk and the ``window - 1`` tokens before
it, from anywhere inside a block, however long the sequence runs.
"""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks ``num_tokens`` tokens fill, the last perhaps in part."""
    return -(-num_tokens // block_size)


def most_blocks_held(num_tokens: int, block_size: int, *, window: int = 0, chunk: int = 1) -> int:
    """The most blocks a sequence of ``num_tokens`` holds at once. ``window``: the sliding window of a
    model whose every layer has one (0: none, so every block stays while the sequence runs);
    ``chunk``: the most of its tokens one step computes."""
    whole = blocks_for(num_tokens, block_size)
    if window <= 0:
        return whole
    return min(whole, blocks_for(window - 1 + max(chunk, 1), block_size) + 1)
