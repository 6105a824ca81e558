"""Each running sequence's decode inputs on the device, in a row of preallocated tensors it keeps
while it runs: its next token, that token's position, and its block table.

Why rows that persist: a decode step needs, for every request, the token to feed, its position,
its KV slot and where its context lies in the paged cache. Built from Python lists every step,
that is a loop over the running requests and a host-to-device copy of every block table. Here:

- the next token and position are written on the device by the step that sampled the token
  (``commit``): a decode step's inputs never wait for the last step's tokens to reach the host,
  which is what preparing a step while the device computes the one before needs;
- the block table is mirrored incrementally: only the blocks appended since the row's last step
  are written, about one entry per request every ``block_size`` steps;
- a step uploads the rows it runs (and those few entries) in one host-to-device copy, and the
  model runner gathers ids, positions, slots and context lengths from the rows on the device
  (``decode_step.py``).

A row holds its token and position (``Sequence.decode_live``) from the step that sampled that
token; a sequence about to decode whose token was not sampled here (a prompt whose only
uncomputed token follows cached blocks, the last token of a chunked prefill) is seeded from the
host in the same upload. The last row is the scratch row, never assigned: its table points at
the pool's scratch block, so the padded rows of a static-shape step write and read there only.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import cast

import torch

from executor_service.sequence import Sequence


class DecodeState:
    """Rows of next token, position and block table for up to ``max_seqs`` running sequences."""

    def __init__(
        self, max_seqs: int, max_blocks: int, scratch_block: int, step_capacity: int, device: torch.device
    ) -> None:
        """``max_blocks``: the longest block table; ``step_capacity``: the most rows one step runs, padding included."""
        if max_seqs < 1 or max_blocks < 1 or step_capacity < max_seqs:
            raise ValueError(f"need max_seqs >= 1, max_blocks >= 1 and step_capacity >= max_seqs, got "
                             f"{max_seqs}, {max_blocks}, {step_capacity}")  # fmt: skip
        self.device = device
        self.max_blocks = max_blocks
        self.scratch_row = max_seqs
        rows = max_seqs + 1
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        # Entries past a row's table are never read as context (masked, or past its length), but
        # gathered all the same: the scratch block keeps them a valid index.
        self.tables = torch.full((rows, max_blocks), scratch_block, dtype=torch.long, device=device)
        # The rows the current step runs, in its order, padded with the scratch row: the one input
        # a captured decode step reads besides the rows themselves.
        self.step_rows = torch.full((step_capacity,), self.scratch_row, dtype=torch.long, device=device)
        self._ones = torch.ones(step_capacity, dtype=torch.long, device=device)
        self._free = list(range(max_seqs - 1, -1, -1))  # pop() hands out the lowest row first

    # ---- rows ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Rows no sequence holds."""
        return len(self._free)

    def row_of(self, seq: Sequence) -> int:
        """The sequence's row, assigned on first use."""
        row = seq.decode_row
        if row is None:
            if not self._free:
                raise RuntimeError("more running sequences than decode rows (max_batch_size)")
            row = seq.decode_row = self._free.pop()
            seq.decode_blocks = 0
            seq.decode_live = False
        return row

    def release(self, seq: Sequence) -> None:
        """Give the sequence's row back (it left the batch, or its cache was dropped)."""
        if seq.decode_row is not None:
            self._free.append(seq.decode_row)
        seq.decode_row, seq.decode_blocks, seq.decode_live = None, 0, False

    # ---- one step --------------------------------------------------------------------------
    def sync(self, seqs: Seq[Sequence], batch: int) -> int:
        """Make the rows of ``seqs`` current and put them, padded to ``batch`` with the scratch row,
        in ``step_rows``; return the widest of their block tables. One host-to-device copy."""
        known = [seq.decode_row for seq in seqs]
        rows = cast(list[int], known) if None not in known else [self.row_of(seq) for seq in seqs]
        max_blocks = self.max_blocks
        # Most steps change no table (one request in block_size crosses into a new block) and seed nobody.
        grown = [seq for seq in seqs if len(seq.block_table) != seq.decode_blocks]
        unseeded = [seq for seq in seqs if not seq.decode_live]
        width = max(map(len, (seq.block_table for seq in seqs)), default=1)
        if width > max_blocks:
            raise RuntimeError(f"a block table of {width} blocks exceeds the {max_blocks} a decode row holds")
        count = len(rows)
        values = rows + [self.scratch_row] * (batch - count)
        table_rows: list[int] = []
        table_cols: list[int] = []
        table_blocks: list[int] = []
        for seq in grown:
            start, table = seq.decode_blocks, seq.block_table
            table_rows += [self.row_of(seq)] * (len(table) - start)
            table_cols += range(start, len(table))
            table_blocks += table[start:]
            seq.decode_blocks = len(table)
        seed_rows = [self.row_of(seq) for seq in unseeded]
        seed_tokens = [seq.token_slice(seq.num_computed, seq.num_computed + 1)[0] for seq in unseeded]
        seed_positions = [seq.num_computed for seq in unseeded]
        values += table_rows + table_cols + table_blocks + seed_rows + seed_tokens + seed_positions
        uploaded = self._upload(values)
        self.step_rows[:batch].copy_(uploaded[:batch])
        if table_rows:
            end = batch + 3 * len(table_rows)
            entries = uploaded[batch:end].view(3, -1)
            self.tables.index_put_((entries[0], entries[1]), entries[2])
        if seed_rows:
            seeds = uploaded[batch + 3 * len(table_rows) :].view(3, -1)
            self.tokens.index_copy_(0, seeds[0], seeds[1])
            self.positions.index_copy_(0, seeds[0], seeds[2])
            for seq in unseeded:
                seq.decode_live = True
        return width

    def commit_decodes(self, count: int, sampled: torch.Tensor) -> None:
        """After a decode step of ``count`` rows: each row's next token is its sampled one, one position on."""
        rows = self.step_rows[:count]
        self.tokens.index_copy_(0, rows, sampled)
        self.positions.index_add_(0, rows, self._ones[:count])

    def commit(self, seqs: Seq[Sequence], rows: torch.Tensor, sampled: torch.Tensor, positions: torch.Tensor) -> None:
        """After any step: the rows of the sequences it completed hold their sampled token at ``positions``."""
        self.tokens.index_copy_(0, rows, sampled)
        self.positions.index_copy_(0, rows, positions)
        for seq in seqs:
            seq.decode_live = True

    def forget(self, seqs: Seq[Sequence]) -> None:
        """The step that ran ``seqs`` was never committed: their rows no longer hold their next token."""
        for seq in seqs:
            seq.decode_live = False

    def _upload(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cpu":
            return host
        # Pinned, so the copy is asynchronous; torch's pinned-memory cache keeps the buffer until it is done.
        return host.pin_memory().to(self.device, non_blocking=True)
