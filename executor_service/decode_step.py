"""A step whose every chunk is a one-token decode, run from the persistent decode rows (``decode_state.py``).

The host's part is ``prepare``: one pass over the step's sequences for their rows (and the rare
table entry or seed), one host-to-device copy. The device's part is ``forward``: ids, positions,
KV slots, context lengths and block tables gathered from the rows with a few tensor ops, then the
backend's forward. For a given ``(batch, width)`` ``forward`` has fixed shapes and never waits on
the host, which is what a CUDA graph needs (``decode_graphs.py``).

Static shapes (a backend's ``static_shapes``, the CUDA backend's): the step is padded to the next
batch bucket (1, 2, 4, 8, then steps of 16, as nano-vllm captures them) with the scratch row, and
its tables to the next power-of-two width, so a few graphs serve every step. Padded rows feed
token 0 at position 0 through the scratch block; their logits are dropped. Elsewhere (the CPU
backends) the step runs exactly its own rows and widest table: padding would cost real compute.

Attention reads the paged pool through the rows' block tables: the native kernel on the CPU, in
place; elsewhere each row's ``width`` blocks gathered into one padded batch under a mask, one SDPA
call per layer. The gather has fixed shapes, so it can be captured, but it copies
``batch x width x block_size`` keys and values per layer, whatever each row's real length: a
cost a paged-attention kernel that reads blocks in place would not pay (see docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import chain
from itertools import count as counting

import torch

from executor_service.backends.base import DecodeRead
from executor_service.decode_state import DecodeState
from executor_service.kernels.decode_attention import PagedDecodes
from executor_service.kv_cache import KVPool
from executor_service.paged_attention import AttentionBatch, DecodeGroup
from executor_service.sequence import Sequence

# The backend's forward: (input_ids [N], positions [N], sample rows [S], batch) -> logits [S, vocab].
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch], torch.Tensor]


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 16, up to the first that holds ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    buckets: list[int] = []
    for size in chain((1, 2, 4, 8), counting(16, 16)):
        buckets.append(size)
        if size >= max_batch:
            return tuple(buckets)
    raise AssertionError("unreachable: the sizes never end")


def bucket(size: int, buckets: Seq[int]) -> int:
    """The smallest bucket that holds ``size``."""
    for candidate in buckets:
        if candidate >= size:
            return candidate
    raise ValueError(f"{size} exceeds the largest bucket, {buckets[-1]}")


def width_bucket(width: int, max_width: int) -> int:
    """The next power of two from ``width``, at most ``max_width``."""
    return min(1 << max(width - 1, 0).bit_length(), max_width)


def width_buckets(max_width: int) -> tuple[int, ...]:
    """Every width ``width_bucket`` gives, up to ``max_width``."""
    return tuple(sorted({width_bucket(w, max_width) for w in range(1, max_width + 1)}))


@dataclass(frozen=True)
class DecodeShape:
    """What one decode step computes."""

    count: int  # the step's decodes, whose logits are kept
    batch: int  # rows computed: ``count``, or its bucket when padded
    width: int  # block-table columns each row reads: the widest table, or its bucket when padded


class DecodeStep:
    """Prepares and runs decode-only steps over ``state``'s rows."""

    def __init__(self, pool: KVPool, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.pool = pool
        self.buckets = batch_buckets(max_seqs)
        self.state = DecodeState(max_seqs, max_blocks, pool.scratch_block, self.buckets[-1], device)
        self._rows = torch.arange(self.buckets[-1], device=device)  # row i of the step is query row i
        self._span = torch.arange(max_blocks * pool.block_size, device=device)

    def prepare(self, seqs: Seq[Sequence], static: bool) -> DecodeShape:
        """Upload the step's rows (padded when ``static``); the host's whole part of the step."""
        count = len(seqs)
        batch = bucket(count, self.buckets) if static else count
        width = self.state.sync(seqs, batch)
        if static:
            width = width_bucket(width, self.state.max_blocks)
        return DecodeShape(count, batch, width)

    def forward(self, forward: Forward, decode_read: DecodeRead, batch: int, width: int) -> torch.Tensor:
        """Float logits [batch, vocab] of the rows ``prepare`` uploaded. Fixed shapes for a given
        ``(batch, width)`` and no host synchronisation: the part a CUDA graph captures."""
        state, block_size = self.state, self.pool.block_size
        rows = state.step_rows[:batch]
        input_ids = state.tokens.index_select(0, rows)
        positions = state.positions.index_select(0, rows)
        tables = state.tables[:, :width].index_select(0, rows)  # [batch, width]
        slots = tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1) * block_size
        slots += positions % block_size
        lengths = positions + 1
        query_rows = self._rows[:batch]
        group, native = None, None
        if decode_read is DecodeRead.NATIVE:
            # The kernel reads each table where it starts in the flat rows (its length follows from the context's).
            offsets = rows * state.max_blocks
            native = PagedDecodes(query_rows, lengths, offsets, state.tables.view(-1))
        else:
            mask = self._span[: width * block_size].unsqueeze(0) < lengths.unsqueeze(1)
            group = DecodeGroup(rows=query_rows, block_tables=tables, mask=mask[:, None, None])
        batch_info = AttentionBatch(
            pool=self.pool, slot_mapping=slots, prefills=(), decode_views=(), decodes=group, native_decodes=native
        )
        return forward(input_ids, positions, query_rows, batch_info).float()
