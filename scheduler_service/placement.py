"""Which executor each pending request joins: pure logic, no I/O.

Requests are taken in queue order (lowest score first). Each goes, among the executors with a free
slot and the KV room to hold it, to the one with the least work ahead of it per KV block (the
tokens its requests still expect to process: prefill not yet done and output still expected),
then to the one with the most free KV room. The first request that fits nowhere stops admission for
this round, so a large important request is not starved by smaller, less important ones behind it.

Why work first: most free KV room counts only the tokens already in the cache, so it balances
prompts and ignores the outputs still to come. For 64 requests arriving together over two
executors it put 2,604 expected output tokens on one and 2,139 on the other; the busier one set the
end of the batch while the other sat idle. Balancing the expected tokens splits the same workload
2,365 against 2,378 (docs/performance.md, tenth round). Dividing by the executor's KV size gives a
larger executor proportionally more; equal executors compare work alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutorCapacity:
    executor_id: str
    free_slots: int  # more requests its batch can take
    free_blocks: int  # KV blocks not committed to its requests
    total_blocks: int
    block_size: int
    outstanding_tokens: int = 0  # tokens its requests still expect to process (prefill + output)


@dataclass(frozen=True)
class Candidate:
    request_id: str
    num_tokens: int  # prompt + tokens generated so far (a resumed request re-prefills both)
    expected_tokens: int = 0  # what it will add to its executor's work: num_tokens + expected output


@dataclass(frozen=True)
class Placement:
    request_id: str
    executor_id: str
    blocks: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def place(candidates: Sequence[Candidate], capacities: Sequence[ExecutorCapacity]) -> list[Placement]:
    slots = {c.executor_id: c.free_slots for c in capacities}
    blocks = {c.executor_id: c.free_blocks for c in capacities}
    work = {c.executor_id: c.outstanding_tokens for c in capacities}
    placements: list[Placement] = []
    for cand in candidates:
        fits = []
        for cap in capacities:
            need = blocks_for(cand.num_tokens + 1, cap.block_size)
            eid, size = cap.executor_id, max(1, cap.total_blocks)
            if slots[eid] > 0 and blocks[eid] >= need:
                fits.append((-work[eid] / size, blocks[eid] / size, slots[eid], eid, need))
        if not fits:
            break
        *_, executor_id, need = max(fits)
        slots[executor_id] -= 1
        blocks[executor_id] -= need
        work[executor_id] += cand.expected_tokens
        placements.append(Placement(cand.request_id, executor_id, need))
    return placements


def unplaceable(candidates: Sequence[Candidate], capacities: Sequence[ExecutorCapacity]) -> list[str]:
    """Requests too large for the whole KV cache of every executor: they could only block the queue."""
    if not capacities:
        return []
    return [
        cand.request_id
        for cand in candidates
        if all(blocks_for(cand.num_tokens + 1, cap.block_size) > cap.total_blocks for cap in capacities)
    ]
