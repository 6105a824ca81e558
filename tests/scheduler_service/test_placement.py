"""scheduler_service.placement: queue order, least expected work then most free KV, slots and blocks,
head-of-line stop."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv_blocks import blocks_for
from scheduler_service.placement import IDLE, Candidate, ExecutorCapacity, Placement, place, unplaceable


def cap(executor_id: str, free_blocks: int, free_slots: int = 8, total_blocks: int = 100) -> ExecutorCapacity:
    return ExecutorCapacity(executor_id, free_slots, free_blocks, total_blocks, block_size=16)


def test_no_candidates_places_nothing() -> None:
    assert place([], [cap("a", 50)]) == []


def test_no_executors_places_nothing() -> None:
    assert place([Candidate("r1", 10)], []) == []


def test_placements_keep_queue_order() -> None:
    candidates = [Candidate(f"r{i}", 10) for i in range(5)]
    placements = place(candidates, [cap("a", 50), cap("b", 50)])
    assert [p.request_id for p in placements] == ["r0", "r1", "r2", "r3", "r4"]


def test_request_goes_to_the_executor_with_the_least_work_ahead() -> None:
    busy = ExecutorCapacity("busy", 8, 90, 100, block_size=16, outstanding_tokens=5_000)
    idle = ExecutorCapacity("idle", 8, 20, 100, block_size=16, outstanding_tokens=200)
    assert place([Candidate("r1", 10, 100)], [busy, idle]) == [Placement("r1", "idle", 1)]


def test_successive_requests_split_the_expected_work() -> None:
    # Prompts alike, outputs not: free KV room alone would alternate them and put both long ones
    # on one executor; the expected work puts one long and one short on each.
    expected = [1_000, 1_000, 100, 100]
    candidates = [Candidate(f"r{i}", 20, 20 + n) for i, n in enumerate(expected)]
    placements = place(candidates, [cap("a", 50), cap("b", 50)])
    per_executor = {e: [p.request_id for p in placements if p.executor_id == e] for e in ("a", "b")}
    assert sorted(map(len, per_executor.values())) == [2, 2]
    assert {frozenset(ids) for ids in per_executor.values()} == {frozenset({"r0", "r2"}), frozenset({"r1", "r3"})}


def test_work_is_weighed_against_kv_size() -> None:
    # The same work ahead on an executor with twice the KV is half the load.
    big = ExecutorCapacity("big", 8, 100, 200, block_size=16, outstanding_tokens=1_500)
    small = ExecutorCapacity("small", 8, 100, 100, block_size=16, outstanding_tokens=1_000)
    assert place([Candidate("r1", 10, 50)], [small, big])[0].executor_id == "big"


def test_request_goes_to_the_executor_with_most_free_kv() -> None:
    placements = place([Candidate("r1", 10)], [cap("a", 20), cap("b", 80), cap("c", 50)])
    assert placements == [Placement("r1", "b", 1)]


def test_successive_requests_spread_as_free_kv_changes() -> None:
    # Each 100-token request needs ceil(101 / 16) = 7 blocks.
    candidates = [Candidate(f"r{i}", 100) for i in range(3)]
    placements = place(candidates, [cap("a", 40), cap("b", 45)])
    # b (45) -> b has 38 < a's 40 -> a (40 -> 33) -> b (38).
    assert [p.executor_id for p in placements] == ["b", "a", "b"]
    assert all(p.blocks == 7 for p in placements)


def test_blocks_reserve_room_for_the_next_token() -> None:
    # 16 tokens fill one 16-token block exactly, so the next token needs a second block.
    assert place([Candidate("r1", 15)], [cap("a", 10)])[0].blocks == 1
    assert place([Candidate("r1", 16)], [cap("a", 10)])[0].blocks == 2


def test_executor_without_free_slots_is_skipped_even_with_most_kv() -> None:
    placements = place([Candidate("r1", 10)], [cap("big", 90, free_slots=0), cap("small", 10, free_slots=1)])
    assert placements == [Placement("r1", "small", 1)]


def test_slots_are_consumed_by_placements() -> None:
    candidates = [Candidate(f"r{i}", 10) for i in range(5)]
    placements = place(candidates, [cap("a", 100, free_slots=2), cap("b", 100, free_slots=1)])
    assert len(placements) == 3
    per_executor = {e: sum(p.executor_id == e for p in placements) for e in ("a", "b")}
    assert per_executor == {"a": 2, "b": 1}


def test_blocks_are_consumed_by_placements() -> None:
    # 47 tokens need 3 blocks; 10 free blocks hold three such requests, not four.
    candidates = [Candidate(f"r{i}", 47) for i in range(4)]
    placements = place(candidates, [cap("a", 10)])
    assert [p.request_id for p in placements] == ["r0", "r1", "r2"]
    assert sum(p.blocks for p in placements) == 9


def test_request_needing_exactly_the_free_blocks_fits() -> None:
    # 63 tokens + 1 = 64 = 4 blocks of 16.
    assert place([Candidate("r1", 63)], [cap("a", 4)]) == [Placement("r1", "a", 4)]
    assert place([Candidate("r1", 64)], [cap("a", 4)]) == []


def test_first_request_that_fits_nowhere_stops_admission() -> None:
    candidates = [Candidate("small1", 10), Candidate("huge", 10_000), Candidate("small2", 10)]
    placements = place(candidates, [cap("a", 50), cap("b", 50)])
    # small2 would fit, but it must not overtake the more urgent huge request.
    assert [p.request_id for p in placements] == ["small1"]


def test_head_of_line_request_that_fits_nowhere_places_nothing() -> None:
    assert place([Candidate("huge", 10_000), Candidate("small", 1)], [cap("a", 50)]) == []


def test_behind_a_request_that_fits_nowhere_only_what_ends_first_backfills() -> None:
    """The running requests there still expect at least 300 tokens: a request expecting fewer is done
    before they free anything the blocked one waits for; one expecting more would hold room it needs."""
    busy = ExecutorCapacity("a", 8, 50, 100, block_size=16, outstanding_tokens=2_000, soonest_free_tokens=300)
    candidates = [Candidate("huge", 1_000, 1_500), Candidate("short", 10, 26), Candidate("long", 10, 600)]
    assert [p.request_id for p in place(candidates, [busy])] == ["short"]
    # On an idle executor nothing the blocked request waits for will free: anything may backfill.
    idle = ExecutorCapacity("b", 8, 20, 20, block_size=16, soonest_free_tokens=IDLE)
    assert [(p.request_id, p.executor_id) for p in place(candidates, [busy, idle])] == [("short", "b"), ("long", "b")]


def test_block_size_of_each_executor_is_used() -> None:
    caps = [
        ExecutorCapacity("a", 4, 3, 100, block_size=16),
        ExecutorCapacity("b", 4, 3, 100, block_size=64),
    ]
    # 100 tokens: 7 blocks of 16 (too many for a), 2 blocks of 64 (fits b).
    assert place([Candidate("r1", 100)], caps) == [Placement("r1", "b", 2)]


def test_inputs_are_not_mutated() -> None:
    caps = [cap("a", 10, free_slots=1)]
    cands = [Candidate("r1", 10)]
    place(cands, caps)
    assert caps == [cap("a", 10, free_slots=1)]
    assert cands == [Candidate("r1", 10)]


capacities = st.lists(
    st.builds(
        ExecutorCapacity,
        executor_id=st.just(""),
        free_slots=st.integers(0, 6),
        free_blocks=st.integers(0, 60),
        total_blocks=st.just(60),
        block_size=st.sampled_from([1, 4, 16]),
        outstanding_tokens=st.sampled_from([0, 0, 100, 500]),
        kv_window_tokens=st.sampled_from([0, 0, 16, 64]),
        chunk_tokens=st.sampled_from([8, 32]),
        soonest_free_tokens=st.sampled_from([0, 0, 50, 400]),
    ),
    max_size=4,
).map(
    lambda cs: [
        ExecutorCapacity(
            f"e{i}",
            c.free_slots,
            c.free_blocks,
            c.total_blocks,
            c.block_size,
            outstanding_tokens=c.outstanding_tokens,
            kv_window_tokens=c.kv_window_tokens,
            chunk_tokens=c.chunk_tokens,
            soonest_free_tokens=c.soonest_free_tokens,
        )
        for i, c in enumerate(cs)
    ]
)
candidates = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 300)), max_size=12).map(
    lambda sizes: [Candidate(f"r{i}", n, n + out) for i, (n, out) in enumerate(sizes)]
)


@settings(max_examples=200, deadline=None)
@given(cands=candidates, caps=capacities)
def test_placement_invariants(cands: list[Candidate], caps: list[ExecutorCapacity]) -> None:
    placements = place(cands, caps)
    by_id = {c.executor_id: c for c in caps}
    order = [c.request_id for c in cands]
    # In queue order.
    assert [p.request_id for p in placements] == sorted((p.request_id for p in placements), key=order.index)
    placed = {p.request_id: p for p in placements}
    slots = {c.executor_id: c.free_slots for c in caps}
    blocks = {c.executor_id: c.free_blocks for c in caps}
    work = {c.executor_id: c.outstanding_tokens for c in caps}
    blocked = False
    for cand in cands:
        need = {e: c.request_kv_blocks(cand.num_tokens) for e, c in by_id.items()}
        # Behind a request placed nowhere, only backfills: requests done before any running on
        # their executor is.
        eligible = [e for e in by_id if not blocked or cand.expected_tokens < by_id[e].soonest_free_tokens]
        fitting = [e for e in eligible if slots[e] > 0 and blocks[e] >= need[e]]
        p = placed.get(cand.request_id)
        if p is None:  # left because it fit nowhere it may go
            assert not fitting
            blocked = True
            continue
        assert p.executor_id in fitting
        assert p.blocks == need[p.executor_id]
        # No fitting executor had less work ahead per KV block; among those with as little, none had
        # a larger share of its KV free.
        load = {e: work[e] / by_id[e].total_blocks for e in fitting}
        least = [e for e in fitting if load[e] == min(load.values())]
        assert p.executor_id in least
        best = max(blocks[e] / by_id[e].total_blocks for e in least)
        assert blocks[p.executor_id] / by_id[p.executor_id].total_blocks == best
        slots[p.executor_id] -= 1
        blocks[p.executor_id] -= p.blocks
        work[p.executor_id] += cand.expected_tokens
    assert all(v >= 0 for v in slots.values()) and all(v >= 0 for v in blocks.values())


def test_unplaceable_names_requests_larger_than_every_executor() -> None:
    caps = [
        ExecutorCapacity("small", free_slots=4, free_blocks=2, total_blocks=10, block_size=16),
        ExecutorCapacity("big", free_slots=4, free_blocks=0, total_blocks=20, block_size=16),
    ]
    candidates = [Candidate("fits-big", 300), Candidate("too-big", 400), Candidate("tiny", 3)]
    assert unplaceable(candidates, caps) == ["too-big"]
    assert unplaceable(candidates, []) == []


# ---- executors that release the blocks a sliding window has passed ------------------------------


def windowed(executor_id: str, window: int, free_blocks: int = 15, total_blocks: int = 16) -> ExecutorCapacity:
    """An executor of 16 blocks of 16 tokens whose chunks are at most 64 tokens."""
    return ExecutorCapacity(
        executor_id, 8, free_blocks, total_blocks, block_size=16, kv_window_tokens=window, chunk_tokens=64
    )


def test_a_windowed_executor_takes_a_request_longer_than_its_whole_pool() -> None:
    # 1,000 tokens would fill 63 blocks; with a window of 16 the request holds the blocks its
    # window and one chunk of 64 reach: 79 tokens from anywhere inside a block, 6 blocks.
    long = Candidate("long", 1_000, 1_100)
    assert windowed("w", 16).request_kv_blocks(1_000) == 6
    assert place([long], [windowed("w", 16)]) == [Placement("long", "w", 6, 0)]
    assert unplaceable([long], [windowed("w", 16)]) == []
    # The same pool without a window: it can never hold the request.
    assert place([long], [windowed("plain", 0)]) == []
    assert unplaceable([long], [windowed("plain", 0)]) == ["long"]
    # Among both, only the windowed one can take it.
    assert unplaceable([long], [windowed("plain", 0), windowed("w", 16)]) == []
    assert place([long], [windowed("plain", 0), windowed("w", 16)])[0].executor_id == "w"


def test_a_short_request_on_a_windowed_executor_needs_only_its_length() -> None:
    assert windowed("w", 16).request_kv_blocks(30) == blocks_for(31, 16) == 2
    assert place([Candidate("short", 30, 40)], [windowed("w", 16)]) == [Placement("short", "w", 2, 0)]


def test_windowed_requests_fill_the_free_blocks_they_hold() -> None:
    # 15 free blocks hold two requests of 6, not a third.
    cands = [Candidate(f"r{i}", 1_000, 1_100) for i in range(3)]
    assert [p.request_id for p in place(cands, [windowed("w", 16)])] == ["r0", "r1"]


# ---- placement by cached prefix and load ---------------------------------------------------


def loaded(executor_id: str, work: int, free_blocks: int = 80, free_slots: int = 8) -> ExecutorCapacity:
    return ExecutorCapacity(executor_id, free_slots, free_blocks, 100, block_size=16, outstanding_tokens=work)


def test_a_cached_prefix_draws_the_request_to_its_holder() -> None:
    cand = Candidate("r1", 1_000, 1_100, cached_tokens={"b": 960})
    assert place([cand], [loaded("a", 0), loaded("b", 0)]) == [Placement("r1", "b", blocks_for(1_001, 16), 960)]


def test_the_expected_hit_never_covers_the_whole_prompt() -> None:
    # The last prompt token is always computed: its logits give the first output token. The
    # executor takes whole cached blocks before it, so a prompt of exactly four blocks reuses three.
    cand = Candidate("r1", 64, 80, cached_tokens={"a": 64})
    assert cand.hit_on(loaded("a", 0)) == 48 and cand.hit_on(loaded("b", 0)) == 0
    assert place([cand], [loaded("a", 0)])[0].cached_tokens == 48
    assert Candidate("r2", 65, 80, cached_tokens={"a": 64}).hit_on(loaded("a", 0)) == 64


def test_affinity_is_weighed_against_load() -> None:
    cand = Candidate("r1", 1_000, 1_100, cached_tokens={"holder": 900})
    # The holder's extra work is less than the prefill it saves: it keeps the request.
    assert place([cand], [loaded("holder", 800), loaded("light", 0)])[0].executor_id == "holder"
    # More than the saving: the lighter executor takes it, with no hit expected there.
    assert place([cand], [loaded("holder", 1_000), loaded("light", 0)]) == [
        Placement("r1", "light", blocks_for(1_001, 16), 0)
    ]


def test_a_hot_prefix_spreads_once_its_holder_is_saturated() -> None:
    hot = [Candidate(f"r{i}", 500, 600, cached_tokens={"holder": 496}) for i in range(4)]
    # Two slots left on the holder: the rest of the hot requests go to the other executor.
    placements = place(hot, [loaded("holder", 0, free_slots=2), loaded("other", 0)])
    assert [p.executor_id for p in placements] == ["holder", "holder", "other", "other"]
    assert [p.cached_tokens for p in placements] == [496, 496, 0, 0]
    # No KV room on the holder: never chosen, whatever it holds.
    full = place(hot[:1], [loaded("holder", 0, free_blocks=10), loaded("other", 5_000)])
    assert full[0].executor_id == "other"


def test_a_nearly_full_holder_does_not_beat_a_much_lighter_executor() -> None:
    cand = Candidate("r1", 1_000, 1_100, cached_tokens={"holder": 992})

    def holder(free_blocks: int) -> ExecutorCapacity:
        return ExecutorCapacity("holder", 8, free_blocks, 1_400, block_size=16, outstanding_tokens=500)

    light = ExecutorCapacity("light", 8, 1_400, 1_400, block_size=16, outstanding_tokens=0)
    # With room to spare, 500 tokens of extra work are worth the 992 the cache saves...
    assert place([cand], [holder(1_000), light])[0].executor_id == "holder"
    # ...but with 5% of its KV free it is about to evict and preempt: the saving counts a quarter.
    assert place([cand], [holder(70), light]) == [Placement("r1", "light", blocks_for(1_001, 16), 0)]


def test_cached_tokens_do_not_count_as_work_for_the_next_request() -> None:
    cands = [
        Candidate("cached", 1_000, 1_100, cached_tokens={"a": 900}),  # adds 200 to a
        Candidate("miss", 1_000, 1_100),  # b (0) is lighter than a (200)
        Candidate("small", 10, 60),  # a (200) is lighter than b (1,100)
    ]
    placements = place(cands, [loaded("a", 0, free_blocks=100), loaded("b", 0, free_blocks=100)])
    assert [p.executor_id for p in placements] == ["a", "b", "a"]


def test_ties_go_round_the_executors_instead_of_piling_on_one() -> None:
    idle = [loaded(e, 0) for e in ("a", "b", "c")]
    # One miss per round on an idle fleet: the rotation the caller moves sends each elsewhere.
    chosen = [place([Candidate(f"r{i}", 10, 20)], idle, rotation=i)[0].executor_id for i in range(6)]
    assert chosen == ["a", "b", "c", "a", "b", "c"]
    # Within a round each placement moves it on too (these add no work, so only the turn differs).
    free = [ExecutorCapacity(e, 8, 1_000, 1_000, block_size=1_000) for e in ("a", "b", "c")]
    placements = place([Candidate(f"r{i}", 10) for i in range(3)], free, rotation=1)
    assert [p.executor_id for p in placements] == ["b", "c", "a"]


def test_ties_are_broken_by_load_before_the_rotation() -> None:
    # Equal work: the one with more free KV wins whatever the rotation says.
    for rotation in range(3):
        assert place([Candidate("r", 10, 20)], [loaded("a", 0, 50), loaded("b", 0, 90)], rotation)[0].executor_id == "b"


def test_a_later_sample_joins_its_first_samples_executor_while_that_has_room() -> None:
    # The holder is busier, and no cached prefix is known yet: only the affinity sends it there.
    holder = ExecutorCapacity("holder", 2, 50, 100, block_size=16, outstanding_tokens=5_000)
    idle = ExecutorCapacity("idle", 8, 50, 100, block_size=16)
    samples = [Candidate(f"r~{k}", 40, 80, affinity="holder") for k in (1, 2, 3)]
    placements = place(samples, [idle, holder])
    # Two slots there; the third sample goes where the usual rules say rather than wait.
    assert [(p.request_id, p.executor_id) for p in placements] == [
        ("r~1", "holder"),
        ("r~2", "holder"),
        ("r~3", "idle"),
    ]
    assert place([Candidate("r~1", 40, 80, affinity="gone")], [idle, holder])[0].executor_id == "idle"


MARKS = tuple(f"m{k}" for k in range(6))  # a prompt's names of blocks 1, 2, 4, ..., 32


def busy(executor_id: str, work: int, prefix_caching: bool = True) -> ExecutorCapacity:
    return ExecutorCapacity(
        executor_id, 8, 90, 100, block_size=16, outstanding_tokens=work, prefix_caching=prefix_caching
    )


def test_a_prompt_placed_but_not_cached_counts_as_cached_there() -> None:
    cand = Candidate("r1", 600, 700, marks=MARKS, marks_block_size=16)
    placed = {"a": {mark: 1 << k for k, mark in enumerate(MARKS)}}  # 32 blocks: 512 tokens shared
    [placement] = place([cand], [busy("a", 900), busy("b", 500)], placed=placed)
    assert (placement.executor_id, placement.cached_tokens) == ("a", 512)
    assert placement.marks == MARKS  # what its link keeps until its first token
    [elsewhere] = place([cand], [busy("a", 1200), busy("b", 500)], placed=placed)  # saving < extra work
    assert (elsewhere.executor_id, elsewhere.cached_tokens) == ("b", 0)


def test_a_shared_mark_credits_only_the_blocks_it_names() -> None:
    cand = Candidate("r1", 600, 700, marks=MARKS, marks_block_size=16)
    placed = {"a": {"m0": 1, "m1": 2, "other": 32}}  # shares blocks 1 and 2 only
    [placement] = place([cand], [busy("a", 0), busy("b", 0)], placed=placed)
    assert (placement.executor_id, placement.cached_tokens) == ("a", 32)


def test_marks_of_other_block_sizes_or_of_executors_that_do_not_cache_count_for_nothing() -> None:
    placed = {"a": {mark: 1 << k for k, mark in enumerate(MARKS)}}
    other_size = Candidate("r1", 600, 700, marks=MARKS, marks_block_size=32)
    [placement] = place([other_size], [busy("a", 900), busy("b", 500)], placed=placed)
    assert (placement.executor_id, placement.cached_tokens, placement.marks) == ("b", 0, ())
    cand = Candidate("r1", 600, 700, marks=MARKS, marks_block_size=16)
    [placement] = place([cand], [busy("a", 900, prefix_caching=False), busy("b", 500)], placed=placed)
    assert (placement.executor_id, placement.cached_tokens) == ("b", 0)


def test_requests_on_one_new_prefix_in_one_round_are_credited_where_it_was_placed() -> None:
    # Equal executors already busy: the first goes by the tie-break, the second to the other (lighter
    # by the first's work), the rest are credited the shared blocks on both and keep them in balance.
    cands = [Candidate(f"r{i}", 600, 700, marks=MARKS, marks_block_size=16) for i in range(6)]
    roomy = [ExecutorCapacity(e, 8, 390, 400, block_size=16, outstanding_tokens=1000) for e in ("a", "b")]
    placements = place(cands, roomy)
    assert [p.cached_tokens for p in placements] == [0, 0, 512, 512, 512, 512]
    assert sorted(p.executor_id for p in placements) == ["a", "a", "a", "b", "b", "b"]
