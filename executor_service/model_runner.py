"""Runs one packed forward pass over the step's chunks and returns the logits to sample."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from executor_service.backends.base import Backend, DecodeRead
from executor_service.block_allocator import BlockAllocator
from executor_service.kernels.decode_attention import PagedDecodes
from executor_service.kv_cache import KVPool
from executor_service.paged_attention import AttentionBatch, DecodeGroup, DecodeView, PrefillSegment
from executor_service.sequence import Sequence
from executor_service.step_scheduler import ScheduledChunk


class ModelRunner:
    """Owns the KV pool and the backend (which holds the model); turns chunks into one forward pass."""

    def __init__(self, backend: Backend, pool: KVPool, allocator: BlockAllocator, device: torch.device) -> None:
        self.backend = backend
        self.model = backend.model
        self.pool = pool
        self.allocator = allocator
        self.device = device
        # How decodes read their contexts is the backend's choice (backends/base.py, DecodeRead).
        self.decode_read = backend.decode_read

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _context_slots(self, block_table: list[int], length: int) -> torch.Tensor:
        return self._tensor(self.pool.slots(block_table, 0, length))

    def _decode_group(self, rows: list[int], seqs: list[Sequence]) -> DecodeGroup:
        width = max(len(s.block_table) for s in seqs)
        tables = self._tensor([b for s in seqs for b in s.block_table + [0] * (width - len(s.block_table))])
        lengths = self._tensor([s.num_tokens for s in seqs])
        span = torch.arange(width * self.pool.block_size, device=self.device)
        mask = span[None, :] < lengths[:, None]
        return DecodeGroup(
            rows=self._tensor(rows), block_tables=tables.view(len(seqs), width), mask=mask[:, None, None]
        )

    def _prefill_segment(self, row: int, seq: Sequence, start: int, end: int, first: int | None) -> PrefillSegment:
        if start == 0:
            return PrefillSegment(start=row, end=row + end - start, context=None, context_len=end, mask=None)
        queries = torch.arange(start, end, device=self.device)[:, None]
        keys = torch.arange(end, device=self.device)[None, :]
        context = first * self.pool.block_size if first is not None else self._context_slots(seq.block_table, end)
        return PrefillSegment(start=row, end=row + end - start, context=context, context_len=end, mask=keys <= queries)

    @torch.inference_mode()
    def run(self, chunks: Seq[ScheduledChunk[Sequence]], leading: Seq[int] | None = None) -> torch.Tensor:
        """Compute the chunks' K/V into the pool; return float32 logits [num completing chunks, vocab].

        ``leading[i]``: also keep the logits of chunk i's first that many positions (prompt log
        probabilities need every position's); those rows follow the completing chunks', in chunk order.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSegment] = []
        views: list[DecodeView] = []
        decode_rows: list[int] = []
        decode_seqs: list[Sequence] = []
        native_rows: list[int] = []
        native_lengths: list[int] = []
        native_tables: list[list[int]] = []
        sample_rows: list[int] = []
        leading_rows: list[int] = []
        block_size = self.pool.block_size
        for i, chunk in enumerate(chunks):
            seq, row = chunk.seq, len(input_ids)
            start, end = seq.num_computed, seq.num_computed + chunk.num_tokens
            input_ids += seq.token_slice(start, end)
            positions += range(start, end)
            first = self.allocator.contiguous_start(seq.block_table)
            if first is not None:
                slots += range(first * block_size + start, first * block_size + end)
            else:
                slots += self.pool.slots(seq.block_table, start, end)
            if chunk.num_tokens == 1 and start > 0:
                if self.decode_read is DecodeRead.NATIVE:
                    native_rows.append(row)
                    native_lengths.append(end)
                    native_tables.append(seq.block_table)
                elif first is not None and self.decode_read is DecodeRead.IN_PLACE:
                    views.append(DecodeView(row, first * block_size, end))
                else:
                    decode_rows.append(row)
                    decode_seqs.append(seq)
            else:
                prefills.append(self._prefill_segment(row, seq, start, end, first))
            if chunk.completes:
                sample_rows.append(row + chunk.num_tokens - 1)
            if leading:
                leading_rows += range(row, row + leading[i])
        batch = AttentionBatch(
            pool=self.pool,
            slot_mapping=self._tensor(slots),
            prefills=tuple(prefills),
            decode_views=tuple(views),
            decodes=self._decode_group(decode_rows, decode_seqs) if decode_seqs else None,
            native_decodes=PagedDecodes.build(native_rows, native_lengths, native_tables) if native_rows else None,
        )
        kept = sample_rows + leading_rows
        keep = self._tensor(kept or [0])
        logits = self._forward(self._tensor(input_ids), self._tensor(positions), keep, batch)
        return logits.float() if kept else logits[:0].float()

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """Logits of the ``keep`` rows, [len(keep), vocab]."""
        return self.backend.forward(input_ids, positions, keep, batch)
