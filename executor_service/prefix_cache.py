"""Automatic prefix caching: a sequence starts from the longest run of its blocks already cached,
and names its own blocks as they fill, so later sequences can start from them.

The engine calls ``match`` when a sequence joins the batch (new, re-admitted, resumed after a
preemption, or migrated with its output so far), ``share`` before every step and ``name_computed``
after it. The blocks themselves, their reference counts and the eviction order are
``block_allocator``'s.

Requests on one new prefix often arrive together (a burst behind one system prompt, ``n``
samples of a prompt): none finds it cached when it joins. ``share`` makes the first compute it
while the others wait, then start from its blocks, as SGLang's scheduler does for a batch's
shared prefixes. Without it every one of them computed the whole prefix: on a burst of 96 requests
behind 8 system prompts that was twelve times the prefill the prompts needed.
"""

from __future__ import annotations

from common.block_hashing import ROOT, block_hashes
from executor_service.block_allocator import BlockAllocator
from executor_service.sequence import Sequence


class PrefixCache:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
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
        seq.block_names = block_hashes(seq.token_slice(0, seq.num_tokens), block_size)
        blocks = self.allocator.cached_prefix(seq.block_names[: (seq.num_tokens - 1) // block_size])
        seq.block_table.extend(blocks)
        seq.num_named = len(blocks)
        seq.num_computed = len(blocks) * block_size
        self.queries += seq.num_tokens
        self.hits += seq.num_computed

    def share(self, ordered: list[Sequence]) -> list[Sequence]:
        """The sequences this step may compute (``ordered`` in rank order, minus those told to wait).

        A prefill that has computed nothing of its own yet first takes the blocks named since it
        joined. Then, if the block it would compute next is the one a sequence ahead of it is
        computing (the same name), it waits this step and takes that block once it is named.
        """
        if not self.enabled:
            return ordered
        block_size = self.allocator.block_size
        claimed: set[int] = set()  # names of the blocks that sequences ahead of this one compute next
        out: list[Sequence] = []
        for seq in ordered:
            # A sequence that never matched (one scoring its prompt) has names only for the blocks
            # it computed itself, so it neither takes blocks nor waits here.
            if seq.is_decoding or not seq.block_names:
                out.append(seq)
                continue
            if seq.num_computed == len(seq.block_table) * block_size == seq.num_named * block_size:
                self._take_newly_cached(seq)
            next_block = seq.num_computed // block_size
            if next_block < len(seq.block_names) and next_block < (seq.num_tokens - 1) // block_size:
                name = seq.block_names[next_block]
                if name in claimed:
                    continue  # another computes this block now: wait for it
                claimed.add(name)
            out.append(seq)
        return out

    def _take_newly_cached(self, seq: Sequence) -> None:
        """Extend a sequence that holds only cached blocks by those cached since it looked."""
        cap = (seq.num_tokens - 1) // self.allocator.block_size
        start = len(seq.block_table)
        if start >= cap:
            return
        blocks = self.allocator.cached_prefix(seq.block_names[start:cap])
        if blocks:
            seq.block_table.extend(blocks)
            seq.num_named += len(blocks)
            seq.num_computed += len(blocks) * self.allocator.block_size
            self.hits += len(blocks) * self.allocator.block_size

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
            parent = names[-1] if names else ROOT
            names += block_hashes(seq.token_slice(len(names) * block_size, full * block_size), block_size, 0, parent)
        for index in range(seq.num_named, full):
            self.allocator.name(seq.block_table[index], names[index])
        seq.num_named = full
