"""A model's sliding attention window: which keys a windowed layer's query reads, and which KV blocks
no later query reads, so their room goes back to the pool.

transformers' rule (``masking_utils.sliding_window_overlay``, and the ``sliding_window`` its models
hand the attention function): a query at position ``p`` attends to the keys at ``p - size < k <= p``,
itself and the ``size - 1`` before it. Every read path of the paged attention reads those keys only
(``paged_attention.py``), so a sequence of any length is served exactly, not only while it fits
in the window.

When every layer of the model is windowed (Mistral; Qwen2 when ``max_window_layers`` windows them
all; not Gemma 2, whose global layers read every earlier token), a block wholly before the window of
the next position to compute is never read again: it is released (``BlockAllocator.release_front``)
and its table entry becomes a placeholder no read path touches. A named block stays cached for
later prompts, as a finished request's do. A long generation then holds about
``size / block_size + 1`` blocks, however long it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.kv_blocks import blocks_for, most_blocks_held

if TYPE_CHECKING:
    from executor_service.block_allocator import BlockAllocator
    from executor_service.model_support import ModelTraits
    from executor_service.sequence import Sequence


@dataclass(frozen=True)
class SlidingWindow:
    """The window of a model's windowed layers, and whether every layer has it."""

    size: int  # keys a query reads: itself and the size - 1 before it
    every_layer: bool  # no layer reads further back, so blocks the window has passed are released

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a sliding window holds at least one token, got {self.size}")

    @classmethod
    def of(cls, traits: ModelTraits) -> SlidingWindow | None:
        """The loaded model's window; None when every layer attends to every earlier token."""
        if traits.sliding_window is None:
            return None
        return cls(traits.sliding_window, traits.every_layer_windowed)

    @property
    def releasing_size(self) -> int:
        """The window the executor releases blocks behind (``InfoResponse.kv_window_tokens``): its size
        where every layer has it, else 0, as some layer reads every earlier token."""
        return self.size if self.every_layer else 0

    def first_key(self, position: int) -> int:
        """The first key position a query at ``position`` reads."""
        return max(0, position - self.size + 1)

    def span_blocks(self, block_size: int) -> int:
        """The most blocks one query's keys lie in: ``size`` tokens, from anywhere inside a block."""
        return -(-(self.size - 1) // block_size) + 1

    def passed_blocks(self, num_computed: int, block_size: int) -> int:
        """How many of a sequence's first blocks no later query reads, once ``num_computed`` tokens are
        computed (the next query is at that position, later ones further on); 0 when some layer reads
        every earlier token."""
        if not self.every_layer:
            return 0
        return self.first_key(num_computed) // block_size

    def most_blocks_held(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds at once while computed in chunks of at
        most ``chunk`` tokens, its passed blocks released after each: a chunk's keys reach
        ``size - 1`` tokens before it, from anywhere inside a block (the scheduler service counts a
        request's blocks by the same rule, ``common/kv_blocks.py``)."""
        return most_blocks_held(num_tokens, block_size, window=self.releasing_size, chunk=chunk)

    def most_chunk(self, num_blocks: int, block_size: int, num_tokens: int) -> int | None:
        """The largest chunk with which a sequence of ``num_tokens`` fits ``num_blocks`` (at least 1);
        None where its blocks fit whole, so any chunk does."""
        if blocks_for(num_tokens, block_size) <= num_blocks:
            return None
        return max(1, (num_blocks - 1) * block_size - self.releasing_size + 1)

    def release_passed(self, seq: Sequence, allocator: BlockAllocator) -> None:
        """Release the blocks of ``seq`` no later query reads (none unless every layer is windowed)."""
        passed = self.passed_blocks(seq.num_computed, allocator.block_size)
        if passed:
            allocator.release_front(seq.block_table, passed)
