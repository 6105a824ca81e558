"""Runs one packed forward pass over the step's chunks and returns the logits to sample."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from executor_service.kv_cache import KVPool
from executor_service.paged_attention import AttentionBatch, DecodeGroup, PrefillSegment
from executor_service.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` uncomputed tokens of ``seq`` to compute this step."""

    seq: Sequence
    num_tokens: int

    @property
    def completes(self) -> bool:
        """After this chunk every token is computed, so the last position's logits give the next token."""
        return self.num_tokens == self.seq.num_uncomputed


class ModelRunner:
    """Owns the model and the KV pool; turns chunks into one forward pass."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self._block_offsets = torch.arange(pool.block_size, device=device)

    def _context_slots(self, block_table: list[int], length: int) -> torch.Tensor:
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        return (table[:, None] * self.pool.block_size + self._block_offsets).flatten()[:length]

    def _decode_group(self, rows: list[int], seqs: list[Sequence]) -> DecodeGroup:
        lengths = torch.tensor([s.num_tokens for s in seqs], device=self.device)
        width = max(len(s.block_table) for s in seqs)
        tables = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.long)
        longest = int(lengths.max())
        slots = (tables[:, :, None] * self.pool.block_size + self._block_offsets).reshape(len(seqs), -1)[:, :longest]
        mask = torch.arange(longest, device=self.device)[None, :] < lengths[:, None]
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        return DecodeGroup(rows=rows_t, context_slots=slots, mask=mask[:, None, None, :])

    def _prefill_segment(self, row: int, seq: Sequence, start: int, end: int) -> PrefillSegment:
        if start == 0:
            return PrefillSegment(start=row, end=row + end - start, context_slots=None, mask=None)
        queries = torch.arange(start, end, device=self.device)[:, None]
        keys = torch.arange(end, device=self.device)[None, :]
        return PrefillSegment(
            start=row,
            end=row + end - start,
            context_slots=self._context_slots(seq.block_table, end),
            mask=keys <= queries,
        )

    @torch.inference_mode()
    def run(self, chunks: Seq[ScheduledChunk]) -> torch.Tensor:
        """Compute the chunks' K/V into the pool; return float32 logits [num completing chunks, vocab]."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSegment] = []
        decode_rows: list[int] = []
        decode_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        for chunk in chunks:
            seq, row = chunk.seq, len(input_ids)
            start, end = seq.num_computed, seq.num_computed + chunk.num_tokens
            input_ids += seq.token_slice(start, end)
            positions += range(start, end)
            slots += self.pool.slots(seq.block_table, start, end)
            if chunk.num_tokens == 1 and start > 0:
                decode_rows.append(row)
                decode_seqs.append(seq)
            else:
                prefills.append(self._prefill_segment(row, seq, start, end))
            if chunk.completes:
                sample_rows.append(row + chunk.num_tokens - 1)
        batch = AttentionBatch(
            pool=self.pool,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            prefills=tuple(prefills),
            decodes=self._decode_group(decode_rows, decode_seqs) if decode_seqs else None,
        )
        output = self.model(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            use_cache=False,
            logits_to_keep=torch.tensor(sample_rows or [0], dtype=torch.long, device=self.device),
            baton_batch=batch,
        )
        logits = output.logits[0]
        return logits.float() if sample_rows else logits[:0].float()
