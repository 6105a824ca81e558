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
place; torch's FlashAttention on CUDA, in place, where the block size and dtype let it
(``paged_decode.py``, ``DecodeRead.PAGED``); elsewhere each row's ``width`` blocks gathered into one
padded batch under a mask, one SDPA call per layer. The gather has fixed shapes, so it can be
captured, but it copies ``batch x width x block_size`` keys and values per layer, whatever each
row's real length: the cost the in-place reads do not pay (see docs/performance.md).
A sliding window's layers gather each row's blocks from the first its window covers, at most the
window's span of blocks (``SlidingWindow.span_blocks``); where every layer is windowed that span is
the step's width, however long the sequences.
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
from executor_service.paged_attention import AttentionBatch, ContextReads, DecodeGroup
from executor_service.paged_decode import PagedGroup
from executor_service.sequence import Sequence
from executor_service.sliding_window import SlidingWindow

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
    # Block-table columns each row reads: the widest table (capped to the window's span where every
    # layer is windowed), or its bucket when padded.
    width: int


class DecodeStep:
    """Prepares and runs decode-only steps over ``state``'s rows."""

    def __init__(
        self, pool: KVPool, max_seqs: int, max_blocks: int, device: torch.device, window: SlidingWindow | None = None
    ) -> None:
        """``window``: the model's sliding window, when it has one."""
        self.pool = pool
        self.buckets = batch_buckets(max_seqs)
        self.state = DecodeState(max_seqs, max_blocks, pool.scratch_block, self.buckets[-1], device)
        self.window = window
        self._reads_full = window is None or not window.every_layer
        self._window_blocks = window.span_blocks(pool.block_size) if window is not None else 0
        self._rows = torch.arange(self.buckets[-1], device=device)  # row i of the step is query row i
        self._columns = torch.arange(max_blocks, device=device)
        self._span = torch.arange(max_blocks * pool.block_size, device=device)

    def prepare(self, seqs: Seq[Sequence], static: bool) -> DecodeShape:
        """Upload the step's rows (padded when ``static``); the host's whole part of the step."""
        count = len(seqs)
        batch = bucket(count, self.buckets) if static else count
        width = self.read_width(self.state.sync(seqs, batch))
        if static:
            width = width_bucket(width, self.state.max_blocks)
        return DecodeShape(count, batch, width)

    def read_width(self, table_width: int) -> int:
        """The block-table columns a step reads whose widest table has ``table_width`` blocks: all of
        them, or the window's span where every layer reads its window only."""
        return table_width if self._reads_full else min(table_width, self._window_blocks)

    def forward(self, forward: Forward, decode_read: DecodeRead, batch: int, width: int) -> torch.Tensor:
        """Logits [batch, vocab] of the rows ``prepare`` uploaded, in the model's dtype. Fixed shapes for a given
        ``(batch, width)`` and no host synchronisation: the part a CUDA graph captures."""
        state, block_size = self.state, self.pool.block_size
        rows = state.step_rows[:batch]
        input_ids = state.tokens.index_select(0, rows)
        positions = state.positions.index_select(0, rows)
        tables = state.tables.view(-1)  # row r's table starts at r * max_blocks
        starts = rows * state.max_blocks
        slots = tables.index_select(0, starts + positions // block_size) * block_size + positions % block_size
        lengths = positions + 1
        query_rows = self._rows[:batch]
        # The kernel reads each table where it starts in the flat rows (its length follows from the
        # context's) and cuts a window itself: both kinds of layer share it.
        native = PagedDecodes(query_rows, lengths, starts, tables) if decode_read is DecodeRead.NATIVE else None
        full = windowed = None
        if self._reads_full:
            group = paged = None
            if decode_read is DecodeRead.PAGED:
                paged = PagedGroup.of(query_rows, state.tables[:, :width].index_select(0, rows), lengths)
            elif native is None:
                mask = self._span[: width * block_size].unsqueeze(0) < lengths.unsqueeze(1)
                read = state.tables[:, :width].index_select(0, rows)  # [batch, width]
                group = DecodeGroup(rows=query_rows, block_tables=read, mask=mask[:, None, None])
            full = ContextReads(window=None, decodes=group, native_decodes=native, paged_decodes=paged)
        if self.window is not None:
            size, group = self.window.size, None
            if native is None:
                # Each row's blocks from the first its window covers; columns past its table are masked
                # (clamped, so the index stays in its row).
                count = min(width, self._window_blocks)
                first = (positions - (size - 1)).clamp(min=0) // block_size  # [batch]
                columns = (first.unsqueeze(1) + self._columns[:count]).clamp(max=state.max_blocks - 1)
                read = tables[starts.unsqueeze(1) + columns]  # [batch, count]
                keys = (first * block_size).unsqueeze(1) + self._span[: count * block_size]
                mask = (keys <= positions.unsqueeze(1)) & (keys > (positions - size).unsqueeze(1))
                group = DecodeGroup(rows=query_rows, block_tables=read, mask=mask[:, None, None])
            windowed = ContextReads(window=size, decodes=group, native_decodes=native)
        batch_info = AttentionBatch(pool=self.pool, slot_mapping=slots, full=full, windowed=windowed)
        return forward(input_ids, positions, query_rows, batch_info)
