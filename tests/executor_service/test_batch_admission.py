"""The executor's admission rule, alone: no model, no engine."""

from __future__ import annotations

from executor_service.batch_admission import Admission, judge_admission
from executor_service.block_allocator import BlockAllocator


def verdict(num_tokens: int, num_running: int, token_budget: int = 512) -> Admission:
    kv = BlockAllocator(num_blocks=4, block_size=16)  # 64 token slots
    return judge_admission(
        num_tokens, num_running, max_model_len=100, max_batch_size=8, token_budget=token_budget, kv=kv
    )


def test_a_request_that_fits_is_admitted() -> None:
    assert verdict(10, 0) is Admission.ADMIT
    assert verdict(63, 7) is Admission.ADMIT  # its next token still has a slot


def test_too_long_for_the_kv_cache_or_the_model() -> None:
    assert verdict(64, 0) is Admission.TOO_LONG  # the next token would need a fifth block
    assert verdict(100, 0) is Admission.TOO_LONG


def test_the_batch_bound_keeps_a_token_of_the_budget_for_prefill() -> None:
    assert verdict(10, 8) is Admission.BATCH_FULL
    assert verdict(10, 3, token_budget=4) is Admission.BATCH_FULL
    assert verdict(10, 2, token_budget=4) is Admission.ADMIT
