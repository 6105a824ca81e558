"""Runs one forward pass over the step's chunks and returns the logits to sample.

Two ways in. A step of one-token decodes only (most steps once prompts are in) runs from the
persistent decode rows (``decode_step.py``): the host uploads the rows it runs, the device
gathers the rest, and on a backend with static shapes the step is padded to a batch bucket and,
on CUDA with ``executor.cuda_graphs``, replayed from a captured graph (``decode_graphs.py``).
Any other step (a prompt's chunk among the decodes) is packed from the sequences' lists, request
by request, as below: those steps are dominated by the prefill's compute.

After sampling, ``commit`` writes the sampled tokens into the rows on the device, so the next
decode step needs nothing from the host but which rows run.

A sliding-window model's steps carry the reads of its windowed layers, each from the first key its
window covers (``sliding_window.py``), beside the full-attention reads of its other layers; a model
whose every layer is windowed gets the windowed reads alone, which never reach the blocks its
window has passed (released, ``SlidingWindow.release_passed``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from executor_service.backends.base import Backend, DecodeRead
from executor_service.block_allocator import BlockAllocator
from executor_service.decode_graphs import DecodeGraphs
from executor_service.decode_step import DecodeShape, DecodeStep, width_bucket, width_buckets
from executor_service.kernels import prefill_attention
from executor_service.kernels.decode_attention import PagedDecodes
from executor_service.kernels.prefill_attention import PagedPrefills
from executor_service.kv_cache import KVPool
from executor_service.paged_attention import (
    AttentionBatch,
    ContextBlocks,
    ContextReads,
    DecodeGroup,
    DecodeView,
    PrefillSegment,
)
from executor_service.paged_decode import PagedGroup
from executor_service.sequence import Sequence
from executor_service.sliding_window import SlidingWindow
from executor_service.step_scheduler import ScheduledChunk

# Decode graphs captured before serving cover contexts up to this many tokens, most requests' (a chat
# turn, a benchmark's prompt and output): 7 widths per batch bucket; the widest gathers 256 x 1024
# tokens' K and V a layer (about 0.5 GB in bf16 for 8 KV heads of 64, in the graphs' shared pool).
GRAPH_CONTEXT_TOKENS = 1024


@dataclass(frozen=True)
class _Uncommitted:
    """What ``commit`` writes once the step's tokens are sampled."""

    seqs: Seq[Sequence]  # the step's completing sequences, in sampling order
    rows: torch.Tensor | None  # their decode rows; None: a decode step's (``DecodeState.step_rows``)
    positions: torch.Tensor | None  # the position after each; None: a decode step's (one on)


class ModelRunner:
    """Owns the KV pool and the backend (which holds the model); turns chunks into one forward pass."""

    def __init__(
        self,
        backend: Backend,
        pool: KVPool,
        allocator: BlockAllocator,
        device: torch.device,
        *,
        max_seqs: int,
        max_model_len: int,
        cuda_graphs: bool = False,
        window: SlidingWindow | None = None,
    ) -> None:
        """``max_seqs``: running sequences at most; ``cuda_graphs``: capture static decode steps (CUDA only);
        ``window``: the model's sliding window, when it has one."""
        self.backend = backend
        self.model = backend.model
        self.pool = pool
        self.allocator = allocator
        self.device = device
        self.window = window
        # Full-attention reads, unless every layer is windowed.
        self._reads_full = window is None or not window.every_layer
        # How decodes read their contexts is the backend's choice (backends/base.py, DecodeRead).
        self.decode_read = backend.decode_read
        # Prompt chunks read the pool in place through the native kernel beside the native decode
        # kernel, where it serves the pool (float32: AVX-512, or AVX2 and FMA; bfloat16: AVX512-BF16)
        # and no layer is windowed.
        self.native_prefill = (
            self.decode_read is DecodeRead.NATIVE
            and window is None
            and prefill_attention.available(device, pool.keys.dtype, pool.keys.shape[-1])
        )
        self.decode = DecodeStep(pool, max_seqs, allocator.blocks_for(max_model_len), device, window)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda" and backend.static_shapes:
            self.graphs = DecodeGraphs(self._decode_forward, self.decode.buckets[-1])
        self._uncommitted: _Uncommitted | None = None

    def describe(self) -> str:
        """How decode steps run, for the log."""
        if self.decode_read is DecodeRead.IN_PLACE:
            return "decode steps packed per request (in-place context views)"
        if not self.backend.static_shapes:
            return "decode steps from persistent rows, unpadded"
        buckets = self.decode.buckets
        how = "captured as CUDA graphs" if self.graphs is not None else "eager"
        return f"decode steps from persistent rows, padded to batch buckets {buckets[0]}..{buckets[-1]}, {how}"

    def capture_decode_graphs(self, max_context: int = GRAPH_CONTEXT_TOKENS) -> int:
        """Before serving: capture the decode step at every batch bucket and every table width up to
        ``max_context`` tokens (longer contexts capture on first use). Returns the graphs captured."""
        graphs = self.graphs
        if graphs is None:
            return 0
        state = self.decode.state
        widest = width_bucket(self.decode.read_width(self.allocator.blocks_for(max_context)), state.max_blocks)
        state.step_rows.fill_(state.scratch_row)  # every row padding: the captures write the scratch block only
        with torch.inference_mode():
            for batch in reversed(self.decode.buckets):
                for width in reversed(width_buckets(widest)):
                    if not graphs.disabled:
                        graphs.capture(batch, width)
        return len(graphs.captured)

    def release(self, seq: Sequence) -> None:
        """The sequence left the batch (or dropped its cache): its decode row is free."""
        self.decode.state.release(seq)

    def commit(self, sampled: torch.Tensor) -> None:
        """Record the last step's sampled tokens [completing chunks] in the decode rows, on the device."""
        pending, self._uncommitted = self._uncommitted, None
        if pending is None:
            return
        if sampled.shape[0] != len(pending.seqs):
            raise ValueError(f"{sampled.shape[0]} sampled tokens for {len(pending.seqs)} completed sequences")
        state = self.decode.state
        if pending.rows is None or pending.positions is None:
            state.commit_decodes(len(pending.seqs), sampled)
        else:
            state.commit(pending.seqs, pending.rows, sampled, pending.positions)

    @torch.inference_mode()
    def run(self, chunks: Seq[ScheduledChunk[Sequence]], leading: Seq[int] | None = None) -> torch.Tensor:
        """Compute the chunks' K/V into the pool; return logits [num completing chunks, vocab] in the
        model's dtype (a greedy argmax reads bfloat16 as it is; what adjusts logits widens them first).

        ``leading[i]``: also keep the logits of chunk i's first that many positions, after the
        completing chunks' rows (see ``_run_packed``); such a step always takes the packed path.
        """
        if self._uncommitted is not None:  # the last step's tokens never reached its rows
            self.decode.state.forget(self._uncommitted.seqs)
            self._uncommitted = None
        # A live row is a decoding sequence's, whose one-token chunk completes: most steps read no more.
        if (
            not leading
            and self.decode_read is not DecodeRead.IN_PLACE
            and all(c.num_tokens == 1 and (c.seq.decode_live or c.completes) for c in chunks)
        ):
            return self._run_decodes([chunk.seq for chunk in chunks])
        return self._run_packed(chunks, leading)

    def _run_decodes(self, seqs: list[Sequence]) -> torch.Tensor:
        """A step of one-token chunks (decodes, or one-token prompts): every one completes."""
        shape = self.decode.prepare(seqs, self.backend.static_shapes)
        self._uncommitted = _Uncommitted(seqs, None, None)
        return self._forward_decodes(shape)[: shape.count]

    def _forward_decodes(self, shape: DecodeShape) -> torch.Tensor:
        """The decode step's device part, logits [shape.batch, vocab]: replayed from its graph, or eager."""
        graphs = self.graphs
        if graphs is not None and self.backend.static_shapes:
            return graphs.run(shape.batch, shape.width)
        return self._decode_forward(shape.batch, shape.width)

    def _decode_forward(self, batch: int, width: int) -> torch.Tensor:
        """The decode step's forward for ``(batch, width)``, eagerly: what a graph captures."""
        return self.decode.forward(self._forward, self.decode_read, batch, width)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _keys_slot(self, table: list[int], key_start: int, end: int) -> int | None:
        """The slot of token ``key_start`` when tokens ``key_start..end-1`` lie in consecutive blocks, else None."""
        size = self.pool.block_size
        first = self.allocator.contiguous_start(table[key_start // size : (end - 1) // size + 1])
        return None if first is None else first * size + key_start % size

    def _key_start(self, window: SlidingWindow | None, position: int) -> int:
        """The first key a read for ``window`` (None: full attention) needs, for queries from ``position`` on."""
        return 0 if window is None else window.first_key(position)

    def _prefill_segment(
        self, row: int, table: list[int], start: int, end: int, window: SlidingWindow | None
    ) -> PrefillSegment:
        chunk_end = row + end - start
        if start == 0:  # a fresh prefill reads its own K/V: cut to the window only where the window cuts in
            band = None
            if window is not None and end > window.size:
                index = torch.arange(end, device=self.device)
                offset = index[:, None] - index[None, :]  # query - key
                band = (offset >= 0) & (offset < window.size)
            return PrefillSegment(start=row, end=chunk_end, context=None, context_len=end, mask=band)
        key_start = self._key_start(window, start)
        queries = torch.arange(start, end, device=self.device)[:, None]
        keys = torch.arange(key_start, end, device=self.device)[None, :]
        mask = keys <= queries
        if window is not None:
            mask &= keys > queries - window.size
        context: int | ContextBlocks | None = self._keys_slot(table, key_start, end)
        if context is None:
            size = self.pool.block_size
            blocks = self._tensor(table[key_start // size : (end - 1) // size + 1])
            context = ContextBlocks(blocks, key_start % size, size)
        return PrefillSegment(start=row, end=chunk_end, context=context, context_len=end - key_start, mask=mask)

    def _padded_tables(self, seqs: list[Sequence], firsts: list[int], ends: list[int]) -> torch.Tensor:
        """[len(seqs), W] each sequence's blocks from block ``firsts[i]`` to the one holding token
        ``ends[i] - 1``, padded with the scratch block."""
        size = self.pool.block_size
        tables = [
            s.block_table[first : (end - 1) // size + 1] for s, first, end in zip(seqs, firsts, ends, strict=True)
        ]
        width = max(map(len, tables))
        padding = [self.pool.scratch_block] * width
        return self._tensor([b for table in tables for b in table + padding[len(table) :]]).view(len(seqs), width)

    def _decode_reads(
        self, rows: list[int], seqs: list[Sequence], ends: list[int], window: SlidingWindow | None
    ) -> tuple[DecodeGroup | None, PagedGroup | None]:
        """The step's single-token chunks that read ``window``'s keys (None: full attention) and are
        not read one by one: in place through their tables (``DecodeRead.PAGED``, full attention), or
        else their blocks from the first each reads, gathered under masks. ``ends[i]``: the context
        the chunk attends to, its own token included; a chunk of a prompt that has more to come stops
        there, short of ``num_tokens`` (its later positions are not computed yet)."""
        if not seqs:
            return None, None
        lengths = self._tensor(ends)
        if window is None and self.decode_read is DecodeRead.PAGED:
            tables = self._padded_tables(seqs, [0] * len(seqs), ends)
            return None, PagedGroup.of(self._tensor(rows), tables, lengths)
        size = self.pool.block_size
        firsts = [self._key_start(window, s.num_computed) // size for s in seqs]
        tables = self._padded_tables(seqs, firsts, ends)
        positions = self._tensor(firsts)[:, None] * size + torch.arange(tables.shape[1] * size, device=self.device)
        mask = positions < lengths[:, None]
        if window is not None:
            mask &= positions >= lengths[:, None] - window.size
        return DecodeGroup(rows=self._tensor(rows), block_tables=tables, mask=mask[:, None, None]), None

    def _run_packed(self, chunks: Seq[ScheduledChunk[Sequence]], leading: Seq[int] | None = None) -> torch.Tensor:
        """Any step: every chunk's tokens packed side by side, built from the sequences' lists.

        ``leading[i]``: also keep the logits of chunk i's first that many positions (prompt log
        probabilities need every position's); those rows follow the completing chunks', in chunk order.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        kinds: list[SlidingWindow | None] = [None] if self._reads_full else []
        if self.window is not None:
            kinds.append(self.window)
        prefills: list[list[PrefillSegment]] = [[] for _ in kinds]
        views: list[list[DecodeView]] = [[] for _ in kinds]
        gathered_rows: list[list[int]] = [[] for _ in kinds]
        gathered_seqs: list[list[Sequence]] = [[] for _ in kinds]
        gathered_ends: list[list[int]] = [[] for _ in kinds]
        native_rows: list[int] = []
        native_lengths: list[int] = []
        native_tables: list[list[int]] = []
        prefill_rows: list[int] = []
        prefill_counts: list[int] = []
        prefill_starts: list[int] = []
        prefill_tables: list[list[int]] = []
        sample_rows: list[int] = []
        leading_rows: list[int] = []
        completing: list[Sequence] = []
        next_positions: list[int] = []
        for i, chunk in enumerate(chunks):
            seq, row = chunk.seq, len(input_ids)
            start, end = seq.num_computed, seq.num_computed + chunk.num_tokens
            table = seq.block_table
            input_ids += seq.token_slice(start, end)
            positions += range(start, end)
            written = self._keys_slot(table, start, end)
            if written is not None:
                slots += range(written, written + end - start)
            else:
                slots += self.pool.slots(table, start, end)
            if chunk.num_tokens == 1 and start > 0:
                if self.decode_read is DecodeRead.NATIVE:  # one kernel call reads both kinds (it cuts the window)
                    native_rows.append(row)
                    native_lengths.append(end)
                    native_tables.append(table)
                else:
                    for k, window in enumerate(kinds):
                        key_start = self._key_start(window, start)
                        first = self._keys_slot(table, key_start, end)
                        if first is not None and self.decode_read is DecodeRead.IN_PLACE:
                            views[k].append(DecodeView(row, first, end - key_start))
                        else:
                            gathered_rows[k].append(row)
                            gathered_seqs[k].append(seq)
                            gathered_ends[k].append(end)
            elif self.native_prefill:
                prefill_rows.append(row)
                prefill_counts.append(end - start)
                prefill_starts.append(start)
                prefill_tables.append(table)
            else:
                for k, window in enumerate(kinds):
                    prefills[k].append(self._prefill_segment(row, table, start, end, window))
            if chunk.completes:
                sample_rows.append(row + chunk.num_tokens - 1)
                completing.append(seq)
                next_positions.append(end)
            if leading:
                leading_rows += range(row, row + leading[i])
        native = PagedDecodes.build(native_rows, native_lengths, native_tables) if native_rows else None
        native_prefills = (
            PagedPrefills.build(prefill_rows, prefill_counts, prefill_starts, prefill_tables) if prefill_rows else None
        )
        reads = []
        for k, window in enumerate(kinds):
            gathered, paged = self._decode_reads(gathered_rows[k], gathered_seqs[k], gathered_ends[k], window)
            reads.append(
                ContextReads(
                    window=None if window is None else window.size,
                    prefills=tuple(prefills[k]),
                    decode_views=tuple(views[k]),
                    decodes=gathered,
                    native_decodes=native,
                    native_prefills=native_prefills,
                    paged_decodes=paged,
                )
            )
        batch = AttentionBatch(
            pool=self.pool,
            slot_mapping=self._tensor(slots),
            full=reads[0] if self._reads_full else None,
            windowed=reads[-1] if self.window is not None else None,
        )
        kept = sample_rows + leading_rows
        keep = self._tensor(kept or [0])
        logits = self._forward(self._tensor(input_ids), self._tensor(positions), keep, batch)
        if completing:
            rows = self._tensor([self.decode.state.row_of(seq) for seq in completing])
            self._uncommitted = _Uncommitted(completing, rows, self._tensor(next_positions))
        return logits if kept else logits[:0]

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """Logits of the ``keep`` rows, [len(keep), vocab]."""
        return self.backend.forward(input_ids, positions, keep, batch)
