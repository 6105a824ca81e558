"""Chooses what one iteration computes: every decode, then prefill chunks, under a token budget.

Every running decode advances every iteration (the budget never starves a running sequence);
the budget bounds the step's total, so prefill gets what the decodes leave.

The scheduler service decides who runs; this only fits the running set into the step and the
KV cache. When blocks run out for a decode it preempts the highest-ranked (least important)
sequence, recompute-style, and the scheduler service re-queues it.

Pure: it sees sequences and blocks only through ``executor_service.schedulable``, so the engine
and a simulated executor run the same rule. The engine's prefix cache joins in through
``may_compute``: a prefill may first take blocks computed before it or by a chunk ahead of it in
this very step, or wait for one (``prefix_cache.StepSharing``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Generic, TypeVar

from executor_service.block_allocator import OutOfBlocks
from executor_service.schedulable import KVBlocks, SchedulableSequence

S = TypeVar("S", bound=SchedulableSequence)


@dataclass(frozen=True)
class ScheduledChunk(Generic[S]):
    """``num_tokens`` uncomputed tokens of ``seq`` to compute this step."""

    seq: S
    num_tokens: int

    @property
    def completes(self) -> bool:
        """After this chunk every token is computed, so the last position's logits give the next token."""
        return self.num_tokens == self.seq.num_uncomputed


@dataclass(frozen=True)
class StepPlan(Generic[S]):
    chunks: tuple[ScheduledChunk[S], ...]
    preempted: tuple[S, ...]
    # The first ``num_decodes`` chunks are the running decodes: one token each, each completing.
    num_decodes: int = 0

    @cached_property  # read twice a step: the thread governor's judgement and the step's report
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class StepScheduler(Generic[S]):
    def __init__(self, allocator: KVBlocks, preempt: Callable[[S], None]) -> None:
        self.allocator = allocator
        self._preempt = preempt  # releases a sequence's blocks and removes it from the batch
        # Last step's decode chunks by sequence: a decode's chunk is the same every step, and building
        # hundreds of them afresh cost a quarter of planning a decode step.
        self._decode_chunks: dict[S, ScheduledChunk[S]] = {}

    def schedule(
        self,
        running: list[S],
        budget: int,
        grants: Mapping[str, int],
        may_compute: Callable[[S, Sequence[ScheduledChunk[S]]], bool] | None = None,
    ) -> StepPlan[S]:
        """``running`` in rank order (most important first). ``may_compute(seq, prefills)``: asked of each
        prefill in turn with the prefill chunks planned ahead of it (not the decodes: a decode's token
        never completes a block that has a name yet); False leaves it out of this step."""
        queue = list(running)
        chunks: list[ScheduledChunk[S]] = []
        preempted: list[S] = []
        decoding: list[S] = []
        waiting: list[S] = []
        for seq in queue:
            (decoding if seq.is_decoding else waiting).append(seq)
        block_size = self.allocator.block_size
        previous, self._decode_chunks = self._decode_chunks, {}
        for seq in decoding:
            if preempted and any(victim is seq for victim in preempted):
                continue  # preempted to make room for someone more important
            # Most decodes have room in their last block: one in block_size needs another.
            if len(seq.block_table) * block_size < seq.num_tokens and not self._fit(seq, queue, chunks, preempted):
                continue
            chunk = previous.get(seq) or ScheduledChunk(seq, 1)
            self._decode_chunks[seq] = chunk
            chunks.append(chunk)
        num_decodes = len(chunks)
        budget -= num_decodes
        if preempted:
            waiting = [seq for seq in waiting if not any(victim is seq for victim in preempted)]
        prefills: list[ScheduledChunk[S]] = []
        for seq in waiting:
            if budget <= 0:
                break
            if may_compute is not None and not may_compute(seq, prefills):
                continue
            size = min(seq.num_uncomputed, budget, grants.get(seq.request_id, budget))
            if size <= 0:
                continue
            try:
                self.allocator.grow(seq.block_table, seq.num_computed + size, seq.final_len)
            except OutOfBlocks:
                continue  # prefill waits for blocks; decodes above keep going
            prefills.append(ScheduledChunk(seq, size))
            budget -= size
        chunks += prefills
        if not chunks and queue:
            # Nothing fits: partially prefilled sequences hold every block. Free the least important
            # that holds any (one that holds none would free nothing, and the next step the same).
            victim = next((s for s in reversed(queue) if s.block_table), queue[-1])
            self._preempt(victim)
            preempted.append(victim)
        return StepPlan(tuple(chunks), tuple(preempted), num_decodes)

    def _fit(self, seq: S, queue: list[S], chunks: list[ScheduledChunk[S]], preempted: list[S]) -> bool:
        """Grow ``seq`` to its tokens, preempting from the back of ``queue`` until it fits."""
        while True:
            try:
                self.allocator.grow(seq.block_table, seq.num_tokens, seq.final_len)
                return True
            except OutOfBlocks:
                scheduled = {id(c.seq) for c in chunks}
                victims = [s for s in queue if id(s) not in scheduled]
                victim = victims[-1] if victims else seq
                queue.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    return False
