"""What the step and admission rules need to know about a sequence and about the KV cache.

The contract between ``step_scheduler``/``batch_admission`` and whoever runs them: the engine runs
them on its ``Sequence`` and ``BlockAllocator``; a simulated executor (``bench/sim_engine.py``) runs
the same rules on sequences with no tokens and no model, so what it measures follows the engine.
"""

from __future__ import annotations

from typing import Protocol


class SchedulableSequence(Protocol):
    """One running request, as far as scheduling is concerned. The rules read it and never mutate it,
    except through ``KVBlocks.grow`` on its ``block_table``."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_table(self) -> list[int]:
        """The KV blocks it owns, in order; the rules grow it through ``KVBlocks.grow``."""
        ...

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V are in the cache."""
        ...

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far, the newest sampled one (not yet computed) included."""
        ...

    @property
    def num_uncomputed(self) -> int:
        """``num_tokens - num_computed``: what is left to prefill, or 1 while decoding."""
        ...

    @property
    def final_len(self) -> int:
        """The most tokens it can reach: room the allocator tries to keep free after it."""
        ...

    @property
    def is_decoding(self) -> bool:
        """Its prompt is computed and it has exactly one uncomputed token: it advances by one a step."""
        ...


class KVBlocks(Protocol):
    """The KV cache's blocks, as the rules see them: how many there are and how to claim more."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the whole cache."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens a block holds."""
        ...

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        ...

    def grow(self, block_table: list[int], num_tokens: int, final_tokens: int = 0) -> None:
        """Extend ``block_table`` in place to hold ``num_tokens`` tokens, or raise
        ``executor_service.block_allocator.OutOfBlocks`` and leave it unchanged."""
        ...
