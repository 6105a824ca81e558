"""Automatic prefix caching: a sequence starts from the longest run of its blocks already cached,
and names its own blocks as they fill, so later sequences can start from them.

The engine calls ``match`` when a sequence joins the batch (new, re-admitted, resumed after a
preemption, or migrated with its output so far), plans every step with a ``sharing`` rule and calls
``name_computed`` after the step. The blocks themselves, their reference counts and the eviction
order are ``block_allocator``'s.

Requests on one new prefix often arrive together (a burst behind one system prompt, ``n``
samples of a prompt): none finds it cached when it joins. The step's ``StepSharing`` lets the first
compute it and the others start from its blocks in the same step, as vLLM's scheduler does: every
layer writes the whole step's keys and values into the pool before any request of the step reads
its context (``paged_attention``), so a chunk may read blocks that a chunk ahead of it fills in
that very forward pass. A block that a chunk ahead only begins (its chunk ends inside the block),
or that a prefill ahead computes next but is not planned to this step, is waited for: the others
take it once it is named. Without this every one of them computed the whole prefix: on a burst of
96 requests behind 8 system prompts that was twelve times the prefill the prompts needed; waiting a
step for it instead would cost the repeats that arrive with their prefix's first request a whole
step of time to first token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from common.block_hashing import UNKEYED, BlockNaming
from executor_service.block_allocator import BlockAllocator
from executor_service.sequence import Sequence
from executor_service.step_scheduler import ScheduledChunk


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, naming: BlockNaming = UNKEYED) -> None:
        self.allocator = allocator
        self.naming = naming  # as the fleet's schedulers name prompts
        self.enabled = allocator.prefix_caching
        # In tokens, since the engine started: what admissions looked up, and what they found.
        self.queries = 0
        self.hits = 0

    def match(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix, as computed.

        Never the whole sequence: its last token is always computed, since its logits give the
        next token. So at most ``(num_tokens - 1) // block_size`` blocks are taken.
        """
        if not self.enabled:
            return
        if seq.block_table or seq.num_computed:
            raise ValueError(f"{seq.request_id} already has blocks; only a fresh sequence matches the cache")
        block_size = self.allocator.block_size
        seq.block_names = self.naming.block_hashes(
            seq.token_slice(0, seq.num_tokens), block_size, parent=seq.prefix_root
        )
        blocks = self.allocator.cached_prefix(seq.block_names[: (seq.num_tokens - 1) // block_size])
        seq.block_table.extend(blocks)
        seq.num_named = len(blocks)
        seq.num_computed = len(blocks) * block_size
        seq.num_cached = seq.num_computed
        if not seq.output_ids:  # see ``count_hit``
            self.queries += seq.num_tokens
        self.count_hit(seq, seq.num_computed)

    def count_hit(self, seq: Sequence, tokens: int) -> None:
        """Count ``tokens`` that ``seq`` took from the cache. As vLLM counts, only a new request's
        prompt: a resumed one (preempted, migrated) finding its own output would count hits that
        no client's prompt made."""
        if not seq.output_ids:
            self.hits += tokens

    def sharing(self) -> StepSharing | None:
        """The rule for one step's prefills (``StepScheduler.schedule``'s ``may_compute``); None when off."""
        return StepSharing(self) if self.enabled else None

    def take_newly_cached(self, seq: Sequence) -> None:
        """Extend a sequence that holds only cached blocks by those cached since it looked."""
        cap = (seq.num_tokens - 1) // self.allocator.block_size
        start = len(seq.block_table)
        if start >= cap:
            return
        blocks = self.allocator.cached_prefix(seq.block_names[start:cap])
        if blocks:
            seq.block_table.extend(blocks)
            seq.num_named += len(blocks)
            taken = len(blocks) * self.allocator.block_size
            seq.num_computed += taken
            seq.num_cached += taken
            self.count_hit(seq, taken)

    def name_computed(self, seq: Sequence) -> None:
        """Name the sequence's blocks that are full and computed and not named yet."""
        if not self.enabled:
            return
        block_size = self.allocator.block_size
        full = seq.num_computed // block_size
        if full <= seq.num_named:
            return
        names = seq.block_names
        if len(names) < full:
            parent = names[-1] if names else seq.prefix_root
            tokens = seq.token_slice(len(names) * block_size, full * block_size)
            names += self.naming.block_hashes(tokens, block_size, 0, parent)
        for index in range(seq.num_named, full):
            self.allocator.name(seq.block_table[index], names[index])
        seq.num_named = full


class StepSharing:
    """One step's sharing of blocks between prefills on the same prefix, asked of each prefill in rank
    order with the prefill chunks planned ahead of it (``may_compute``)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.block_size = cache.allocator.block_size
        # Names of the blocks that chunks planned so far begin and do not fill: a prefill whose next
        # block is one of them waits for it.
        self._claimed: set[int] = set()
        # Blocks that this step's chunks fill, by name: a prefill behind them may start after them.
        self._filling: dict[int, int] = {}
        self._chunks_seen = 0

    def may_compute(self, seq: Sequence, chunks: Seq[ScheduledChunk[Sequence]]) -> bool:
        """Extend a prefill that holds only cached blocks by those named since it joined and those the
        chunks ahead of it fill in this step; False when the block it would compute next is one a
        chunk ahead of it begins (it waits for that block). Only planned chunks claim blocks
        (``_note``): a prefill left out of the step (no KV room for its chunk) holds up no other."""
        # A sequence that never matched (one scoring its prompt) has names only for the blocks it
        # computed itself, so it neither takes blocks nor waits here.
        if seq.is_decoding or not seq.block_names:
            return True
        size = self.block_size
        self._note(chunks)
        if seq.num_computed == len(seq.block_table) * size == seq.num_named * size:
            self.cache.take_newly_cached(seq)
            self._take_filling(seq)
        next_block = seq.num_computed // size
        if next_block < len(seq.block_names) and next_block < (seq.num_tokens - 1) // size:
            return seq.block_names[next_block] not in self._claimed
        return True

    def _take_filling(self, seq: Sequence) -> None:
        """Give ``seq`` the blocks after its own that chunks ahead of it fill in this step. Counted as
        computed and named now: the forward pass fills them before ``seq``'s chunk reads them, and
        their filler names them after the step (both name the same block, which names it once)."""
        if not self._filling:
            return
        size, names, table = self.block_size, seq.block_names, seq.block_table
        cap = min(len(names), (seq.num_tokens - 1) // size)
        while len(table) < cap:
            block = self._filling.get(names[len(table)])
            if block is None:
                return
            self.cache.allocator.add_reference(block)
            table.append(block)
            seq.num_named += 1
            seq.num_computed += size
            seq.num_cached += size
            self.cache.count_hit(seq, size)

    def _note(self, chunks: Seq[ScheduledChunk[Sequence]]) -> None:
        """Record the blocks that the chunks planned since the last look fill (block ``i`` of a chunk
        over tokens ``start..end-1`` fills when ``start < (i + 1) * block_size <= end``), and claim the
        block a chunk ends inside: it is being computed, so a prefill behind waits for it."""
        size = self.block_size
        for chunk in chunks[self._chunks_seen :]:
            filler = chunk.seq
            names = filler.block_names
            start = filler.num_computed
            end = start + chunk.num_tokens
            for index in range(start // size, min(end // size, len(names))):
                self._filling.setdefault(names[index], filler.block_table[index])
            if end % size and end // size < len(names):
                self._claimed.add(names[end // size])
        self._chunks_seen = len(chunks)
