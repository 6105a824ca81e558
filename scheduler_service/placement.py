"""Which executor each pending request joins: pure logic, no I/O.

Requests are taken in queue order (lowest score first) and each goes to the executor with the
most free KV room that can hold it. The first request that fits nowhere stops admission for this
round, so a large important request is not starved by smaller, less important ones behind it.
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


@dataclass(frozen=True)
class Candidate:
    request_id: str
    num_tokens: int  # prompt + tokens generated so far (a resumed request re-prefills both)


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
    placements: list[Placement] = []
    for cand in candidates:
        fits = []
        for cap in capacities:
            need = blocks_for(cand.num_tokens + 1, cap.block_size)
            if slots[cap.executor_id] > 0 and blocks[cap.executor_id] >= need:
                fits.append(
                    (blocks[cap.executor_id] / max(1, cap.total_blocks), slots[cap.executor_id], cap.executor_id, need)
                )
        if not fits:
            break
        _, _, executor_id, need = max(fits)
        slots[executor_id] -= 1
        blocks[executor_id] -= need
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
