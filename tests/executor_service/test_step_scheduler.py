"""executor_service.step_scheduler: what a step computes, and whom it frees when nothing fits."""

from __future__ import annotations

from typing import cast

from common.sampling_params import SamplingParams
from executor_service.block_allocator import BlockAllocator
from executor_service.detokenizer import IncrementalDetokenizer
from executor_service.sequence import Sequence
from executor_service.step_scheduler import StepScheduler


def _sequence(request_id: str, prompt_len: int, rank: float) -> Sequence:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    tokens = list(range(1, prompt_len + 1))
    return Sequence(request_id, tokens, [], params, rank, None, cast(IncrementalDetokenizer, None))


def test_when_nothing_fits_the_least_important_sequence_holding_blocks_is_freed() -> None:
    # Eight blocks of 4 tokens: the partly prefilled prompt holds six and needs ten, the newcomer
    # behind it needs three of the two left. Freeing the newcomer, which holds nothing, would free
    # nothing, and the next step would be the same.
    allocator = BlockAllocator(8, 4)
    partial, newcomer = _sequence("partial", 40, 0.0), _sequence("newcomer", 10, 1.0)
    allocator.grow(partial.block_table, 24)
    partial.num_computed = 24
    freed: list[str] = []

    def preempt(seq: Sequence) -> None:
        freed.append(seq.request_id)
        allocator.release(seq.block_table)

    plan = StepScheduler(allocator, preempt).schedule([partial, newcomer], 64, {})
    assert plan.chunks == () and freed == ["partial"] and allocator.num_free == 8
