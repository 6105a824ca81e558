"""Which executor each pending request joins: pure logic, no I/O.

Requests are taken in queue order (lowest score first). Each goes, among the executors with a free
slot and the KV room to hold it (``request_kv_blocks``: its whole length, or on an executor that
releases the blocks its sliding window has passed, only what the window and one chunk reach), to
the one with the least work ahead of it per KV block (the tokens its requests still expect to
process: prefill not yet done and output still expected), then to the one with the most free KV
room.

A request that fits nowhere keeps its claim on the next room: no request behind it may take room
it waits for. One behind it is placed only on an executor where it expects to be done before any
request running there (its tokens, prompt and expected output, at most the fewest any of them
still expects, ``ExecutorCapacity.soonest_free_tokens``; anything on an idle one, where nothing
the blocked request waits for will free), so it frees what it took before the
blocked request could have had it: backfilling, by the length estimates. Without it one tenant's
requests too large for the room left stalled every other tenant's short ones for minutes, while
with every later request placed the blocked one would wait on each in turn.

Why work first: most free KV room counts only the tokens already in the cache, so it balances
prompts and ignores the outputs still to come. For 64 requests arriving together over two
executors it put 2,604 expected output tokens on one and 2,139 on the other; the busier one set the
end of the batch while the other sat idle. Balancing the expected tokens splits the same workload
2,365 against 2,378 (docs/performance.md, tenth round). Dividing by the executor's KV size gives a
larger executor proportionally more; equal executors compare work alone.

Where an executor's prefix cache already holds the start of a prompt (``Candidate.cached_tokens``,
from the fleet's prefix-cache index), those tokens need no prefill there: they come off that
executor's work for this choice. So the cache decides where, never which request goes next, and
never against load alone: a hot prefix stays on its holder while the holder's work, less the
saving, is still the least, then spreads to another executor, which caches it too. An executor
with no free slot or KV room is never chosen, and as its free KV falls below
``FULL_CREDIT_FREE_KV`` the saving counts for less and less (none when full): there it is about to
evict cached blocks and preempt running work, and a much lighter executor wins.

A prompt placed but not yet cached counts as cached on its executor (``PrefixMarks``): a request
that starts like one placed there a moment ago, in this round or an earlier one whose prefill has
not reported yet, is credited as if that prefix were cached there, since the executor makes a
request wait for blocks another is computing rather than compute them twice. Without it a burst
behind a new system prompt splits across executors by load, and each computes the prompt.

A later sample of a multi-sample request (``Candidate.affinity``) goes to its sample 0's executor
whenever that one has a slot and the KV room: the prompt's blocks are cached there, and sharing
them is the point of placing the samples together. Only when it has no room does the sample go
where the rules above say, to be computed there in full rather than wait.

Ties (equal work, free KV and slots: executors idle, say, or a prompt no one holds) go round the
executors from a ``rotation`` the caller moves on each round, and each placement moves it one
further: a deterministic order would send every miss to one executor (sglang#32983).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common.kv_blocks import most_blocks_held

# An idle executor's ``soonest_free_tokens``: nothing there frees what a blocked request waits for.
IDLE = sys.maxsize

# Below this fraction of its KV blocks free, an executor's cached prefix earns less than its full
# saving, falling linearly to nothing when it is full.
FULL_CREDIT_FREE_KV = 0.2


@dataclass(frozen=True)
class ExecutorCapacity:
    executor_id: str
    free_slots: int  # more requests its batch can take
    free_blocks: int  # KV blocks not committed to its requests
    total_blocks: int
    block_size: int
    outstanding_tokens: int = 0  # tokens its requests still expect to process (prefill + output)
    # Where every layer of its model attends within a sliding window, the window's size
    # (InfoResponse.kv_window_tokens): it releases the blocks the window has passed, so a request
    # there holds a bounded number of blocks however long it is. 0: a request holds its whole length.
    kv_window_tokens: int = 0
    # The most tokens of one request it computes in one step (the largest token budget it may run
    # under): with a window, a request holds the blocks its window and one such chunk reach.
    chunk_tokens: int = 0
    prefix_caching: bool = True  # it keeps prompts' blocks for later requests (InfoResponse.prefix_caching)
    # The fewest tokens any of its requests still expects to process (``IDLE`` where it runs none):
    # a request expecting fewer is done before any of them frees its blocks (backfilling; see the
    # module). 0: none may backfill.
    soonest_free_tokens: int = 0

    def request_kv_blocks(self, num_tokens: int) -> int:
        """KV blocks a request of ``num_tokens`` (prompt + output so far) needs here."""
        return request_kv_blocks(
            num_tokens, self.block_size, kv_window_tokens=self.kv_window_tokens, chunk_tokens=self.chunk_tokens
        )


# Per executor: the marks (``CachedRuns.marks``: a prompt's names of blocks 1, 2, 4, 8, ...) of
# prompts placed there whose blocks its prefix cache may not have reported yet, each with the
# blocks it names. Two prompts that share mark k share their first 2**k blocks (the names chain),
# so a shared mark stands for at least that much of a prefix, at most half of it unseen.
PrefixMarks = Mapping[str, Mapping[str, int]]


@dataclass(frozen=True)
class Candidate:
    request_id: str
    num_tokens: int  # prompt + tokens generated so far (a resumed request re-prefills both)
    expected_tokens: int = 0  # what it will add to its executor's work: num_tokens + expected output
    # executor id -> leading tokens of it that executor's prefix cache holds (absent: none)
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    affinity: str = ""  # the executor it goes to whenever that has room ("": none)
    marks: tuple[str, ...] = ()  # its prompt's names of blocks 1, 2, 4, 8, ... (``PrefixMarks``)
    marks_block_size: int = 0  # the block size those names were computed with

    def hit_on(self, cap: ExecutorCapacity, placed_tokens: int = 0) -> int:
        """Tokens its prefill may skip on ``cap``, whose cache holds ``cached_tokens`` of it and whose
        placed prompts ``placed_tokens``: whole blocks, never covering the last token, which must be
        computed for the first output's logits (the executor takes what it holds by the same rule)."""
        held = max(self.cached_tokens.get(cap.executor_id, 0), placed_tokens)
        whole_blocks = (self.num_tokens - 1) // cap.block_size * cap.block_size if cap.block_size > 0 else 0
        return max(0, min(held, whole_blocks))

    def shares_marks_with(self, cap: ExecutorCapacity) -> bool:
        """Whether its marks name blocks ``cap`` would keep: it caches prefixes, in blocks of the
        size the marks were computed with (other sizes name other blocks)."""
        return bool(self.marks) and cap.prefix_caching and cap.block_size == self.marks_block_size

    def placed_tokens(self, placed: Mapping[str, int], cap: ExecutorCapacity) -> int:
        """Its leading tokens that prompts placed on ``cap`` with the marks in ``placed`` share."""
        if not self.shares_marks_with(cap):
            return 0
        return max((placed.get(mark, 0) for mark in self.marks), default=0) * cap.block_size


@dataclass(frozen=True)
class Placement:
    request_id: str
    executor_id: str
    blocks: int
    cached_tokens: int = 0  # the expected prefix-cache hit there: tokens it will not prefill
    marks: tuple[str, ...] = ()  # the candidate's marks, where they name that executor's blocks


def request_kv_blocks(num_tokens: int, block_size: int, *, kv_window_tokens: int = 0, chunk_tokens: int = 0) -> int:
    """KV blocks a request of ``num_tokens`` (prompt + output so far) needs on an executor, its next
    token's included: its whole length, or on an executor that releases the blocks its window has
    passed (``kv_window_tokens`` > 0) what its window and one chunk of ``chunk_tokens`` reach, by the
    rule the executor itself admits requests by."""
    return most_blocks_held(num_tokens + 1, block_size, window=kv_window_tokens, chunk=chunk_tokens)


def place(
    candidates: Sequence[Candidate],
    capacities: Sequence[ExecutorCapacity],
    rotation: int = 0,
    placed: PrefixMarks | None = None,
) -> list[Placement]:
    """Candidates in order, each to the executor where it is cheapest (see the module's text);
    ``rotation`` picks which executor a tie goes to first; ``placed``: the marks of prompts placed
    on each executor and not yet reported cached there (each placement here adds its own)."""
    slots = {c.executor_id: c.free_slots for c in capacities}
    blocks = {c.executor_id: c.free_blocks for c in capacities}
    work = {c.executor_id: c.outstanding_tokens for c in capacities}
    marks = {c.executor_id: dict((placed or {}).get(c.executor_id, {})) for c in capacities}
    by_id = {c.executor_id: c for c in capacities}
    placements: list[Placement] = []
    n = len(capacities)
    blocked = False  # a request ahead fits nowhere: later ones may only backfill
    for cand in candidates:
        fits = []
        for i, cap in enumerate(capacities):
            need = cap.request_kv_blocks(cand.num_tokens)
            eid, size = cap.executor_id, max(1, cap.total_blocks)
            backfills = not blocked or cand.expected_tokens < cap.soonest_free_tokens
            if slots[eid] > 0 and blocks[eid] >= need and backfills:
                hit = cand.hit_on(cap, cand.placed_tokens(marks[eid], cap))
                credit = hit * min(1.0, blocks[eid] / size / FULL_CREDIT_FREE_KV)
                turn = -((i - rotation) % n)  # the tie-break: the next executor in the rotation
                pinned = eid == cand.affinity
                fits.append((pinned, -(work[eid] - credit) / size, blocks[eid] / size, slots[eid], turn, eid, need))
        if not fits:
            blocked = True
            continue
        *_, executor_id, need = max(fits)
        chosen = by_id[executor_id]
        hit = cand.hit_on(chosen, cand.placed_tokens(marks[executor_id], chosen))
        slots[executor_id] -= 1
        blocks[executor_id] -= need
        work[executor_id] += max(0, cand.expected_tokens - hit)  # at least 1 whenever it is known
        held = cand.marks if cand.shares_marks_with(chosen) else ()
        for k, mark in enumerate(held):
            marks[executor_id][mark] = 1 << k
        placements.append(Placement(cand.request_id, executor_id, need, hit, held))
        rotation += 1
    return placements


def unplaceable(candidates: Sequence[Candidate], capacities: Sequence[ExecutorCapacity]) -> list[str]:
    """Requests that need more than the whole KV cache of every executor: they could only block the queue."""
    if not capacities:
        return []
    return [
        cand.request_id
        for cand in candidates
        if all(cap.request_kv_blocks(cand.num_tokens) > cap.total_blocks for cap in capacities)
    ]
