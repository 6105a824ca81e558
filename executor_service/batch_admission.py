"""Whether the engine takes a request the scheduler service admitted into its running batch.

The scheduler service decides who should run; this is the executor's own last word, from what it
alone knows for sure: its model length, its KV cache and its batch bound.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from executor_service.schedulable import KVBlocks

if TYPE_CHECKING:
    from executor_service.sliding_window import SlidingWindow


class Admission(Enum):
    ADMIT = "admit"
    # It can never run here: longer than the model allows, or than the whole KV cache holds.
    # The request ends with an error.
    TOO_LONG = "too long"
    # The batch is full now; the scheduler service keeps the request queued and tries again.
    BATCH_FULL = "batch full"


def judge_admission(
    num_tokens: int,
    num_running: int,
    *,
    max_model_len: int,
    max_batch_size: int,
    token_budget: int,
    kv: KVBlocks,
    window: SlidingWindow | None = None,
) -> Admission:
    """The verdict on a request of ``num_tokens`` (prompt plus output so far) beside ``num_running``.

    ``window``: the model's sliding window. Where every layer has it, a sequence holds only the blocks
    its window and its current chunk (at most ``token_budget`` tokens) reach, not its whole length.
    """
    held = kv.blocks_for(num_tokens + 1)
    if window is not None:
        held = window.most_blocks_held(num_tokens + 1, token_budget, kv.block_size)
    if num_tokens >= max_model_len or held > kv.num_blocks:
        return Admission.TOO_LONG
    # Keep decodes below the token budget, so prefill always has room to make progress.
    if num_running >= min(max_batch_size, token_budget - 1):
        return Admission.BATCH_FULL
    return Admission.ADMIT
