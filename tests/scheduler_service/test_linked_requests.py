"""scheduler_service.linked_requests: what a linked request still weighs on its executor, and the room and
preemption choices that follow from the requests on it."""

from __future__ import annotations

from common.pb import executor_pb2 as pb
from scheduler_service.linked_requests import LinkedRequest, capacity_of, preemptible


def linked(generated: int, expected_output: int = 100, prompt_len: int = 40) -> LinkedRequest:
    return LinkedRequest("r", prompt_len, generated, 0, 0, None, expected_output=expected_output)


def test_outstanding_tokens_count_the_prompt_until_the_first_token() -> None:
    assert linked(generated=0).outstanding_tokens == 100 + 40
    assert linked(generated=1).outstanding_tokens == 99
    assert linked(generated=60).outstanding_tokens == 40


def test_outstanding_tokens_leave_out_the_prefix_expected_in_the_cache() -> None:
    cached = LinkedRequest("r", 40, 0, 0, 0, None, expected_output=100, cached_tokens=32)
    assert cached.outstanding_tokens == 100 + 8
    whole = LinkedRequest("r", 40, 0, 0, 0, None, expected_output=100, cached_tokens=40)
    assert whole.outstanding_tokens == 100 + 1  # the last prompt token is always computed


def test_a_resumed_request_counts_its_prefill_of_prompt_and_output_until_its_next_token() -> None:
    # Preempted or migrated after 100 of an expected 300 tokens: its new executor prefills all
    # 4,100 tokens again (less what it finds cached) before the 200 still to come.
    resumed = LinkedRequest("r", 4_000, 100, 0, 0, 5, expected_output=300, resumed_with=100)
    assert resumed.prefilling and resumed.outstanding_tokens == 200 + 4_100
    cached = LinkedRequest("r", 4_000, 100, 0, 0, 5, expected_output=300, cached_tokens=4_096, resumed_with=100)
    assert cached.outstanding_tokens == 200 + 4
    resumed.generated = 101
    assert not resumed.prefilling and resumed.outstanding_tokens == 199


def test_a_request_past_its_expected_output_still_weighs_a_token() -> None:
    # The estimator guessed short; the request is still running, so it is not free work.
    assert linked(generated=150).outstanding_tokens == 1


def test_capacity_counts_committed_blocks_slots_and_outstanding_work() -> None:
    info = pb.InfoResponse(block_size=16, kv_blocks_total=200)
    requests = [linked(generated=0, prompt_len=40), linked(generated=10, prompt_len=20)]
    cap = capacity_of("e1", requests, info, max_batch=8, fraction=1.0)
    # 41 and 31 tokens need 3 and 2 blocks; 2 blocks (1 %) stay back as the watermark.
    assert (cap.free_slots, cap.free_blocks, cap.total_blocks) == (6, 200 - 5 - 2, 200)
    assert cap.outstanding_tokens == 140 + 90
    assert capacity_of("e1", requests, info, max_batch=8, fraction=0.5).free_slots == 3


def test_an_idle_executor_offers_every_block() -> None:
    """The watermark is headroom for running decodes: kept back on an idle executor too, a request
    needing more than the rest was never placed, and held up every request queued behind it."""
    info = pb.InfoResponse(block_size=16, kv_blocks_total=200)
    assert capacity_of("e1", [], info, max_batch=8, fraction=1.0).free_blocks == 200


def test_a_windowed_executor_counts_what_each_request_holds_there() -> None:
    # Every layer windowed over 16 tokens, chunks of at most 64: a request holds the blocks 79 tokens
    # reach from anywhere inside a block (6) however long it is, and its whole length when shorter.
    info = pb.InfoResponse(block_size=16, kv_blocks_total=200, kv_window_tokens=16)
    requests = [linked(generated=960, prompt_len=40), linked(generated=0, prompt_len=20)]
    cap = capacity_of("e1", requests, info, max_batch=8, fraction=1.0, chunk_tokens=64)
    assert (cap.kv_window_tokens, cap.chunk_tokens) == (16, 64)
    assert cap.free_blocks == 200 - (6 + 2) - 2
    assert [r.blocks for r in preemptible(requests, set(), cap)] == [6, 2]
    # Without a window the long request holds its 1,001 tokens' 63 blocks.
    plain = capacity_of("e1", requests, pb.InfoResponse(block_size=16, kv_blocks_total=200), 8, 1.0, chunk_tokens=64)
    assert plain.free_blocks == 200 - (63 + 2) - 2
    assert [r.blocks for r in preemptible(requests, set(), plain)] == [63, 2]


def test_requests_being_preempted_are_not_offered_again() -> None:
    requests = [linked(generated=0), LinkedRequest("other", 40, 0, 0, 0, None)]
    cap = capacity_of("e1", requests, pb.InfoResponse(block_size=16, kv_blocks_total=200), max_batch=8, fraction=1.0)
    assert [r.request_id for r in preemptible(requests, {"r"}, cap)] == ["other"]
