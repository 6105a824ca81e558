"""Token batching on the executor: the rules (pure logic), then real stacks that hold tokens, whose
greedy outputs must still equal ``model.generate``'s."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from common.lifecycle import FinishReason
from common.logprobs import Logprobs
from common.pb import generate_pb2 as pb
from executor_service.engine_io import FinishOut, KvCacheEvents, StepOutput, TokenOut
from executor_service.token_batching import StreamInterval, TokenBatcher
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.stack import Stack, joined_tokens, stack_config, start_stack


def step(iteration: int, *tokens: TokenOut, plan_seq: int = 1, **fields: object) -> StepOutput:
    base = StepOutput(
        iteration=iteration,
        plan_seq=plan_seq,
        tokens=tokens,
        finished=(),
        preempted=(),
        rejected=(),
        num_tokens=len(tokens),
        step_time_ns=1000 * iteration,
        num_running=len(tokens),
        kv_blocks_used=iteration,
        kv_blocks_total=100,
        pending_prefill_tokens=0,
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def tok(request_id: str, index: int) -> TokenOut:
    return TokenOut(request_id, (100 + index,), f"t{index}", index)


def started(every: int = 3, wait_ms: float = 1000.0, clock: list[float] | None = None) -> TokenBatcher:
    """A batcher whose stream has already reported requests a and b (plan 1 acknowledged)."""
    now = clock if clock is not None else [0.0]
    held = TokenBatcher(every, wait_ms, clock=lambda: now[0])
    assert held.offer(step(1, tok("a", 0), tok("b", 0))) is not None  # first tokens: at once
    return held


def sizes(report: StepOutput | None) -> dict[str, int]:
    return {} if report is None else {t.request_id: len(t.token_ids) for t in report.tokens}


def test_one_step_a_report_passes_every_output_through() -> None:
    held = TokenBatcher(1, 50.0)
    for i in range(3):
        out = step(i, tok("a", i))
        assert held.offer(out) is out


def test_plain_decode_steps_are_merged_into_one_report() -> None:
    held = started(every=3)
    assert held.offer(step(2, tok("a", 1), tok("b", 1))) is None
    assert held.offer(step(3, tok("a", 2))) is None
    report = held.offer(step(4, tok("a", 3), tok("b", 2)))
    assert report is not None
    # a's three tokens make a report worth sending; b's two ride along (its client takes every token)
    assert [(t.request_id, t.output_index, t.token_ids, t.text) for t in report.tokens] == [
        ("a", 1, (101, 102, 103), "t1t2t3"),
        ("b", 1, (101, 102), "t1t2"),
    ]
    assert (report.iteration, report.kv_blocks_used, report.step_time_ns) == (4, 4, 4000)  # the last step's load
    assert report.num_tokens == 5


def test_merged_tokens_keep_their_logprobs_and_the_prompts() -> None:
    def lp(token: int, value: float) -> Logprobs:
        return Logprobs.build([token], [value], [[token, 1]], [[value, -9.0]])

    prompt = Logprobs.build([1, 2], [math.nan, -1.0], [[0, 0], [2, 3]], [[math.nan, math.nan], [-1.0, -2.0]])
    held = TokenBatcher(3, 1000.0, clock=lambda: 0.0)
    first = tok("a", 0)._replace(logprobs=lp(100, -0.5), prompt_logprobs=prompt)
    assert held.offer(step(1, first)) is not None
    assert held.offer(step(2, tok("a", 1)._replace(logprobs=lp(101, -0.25)))) is None
    assert held.offer(step(3, tok("a", 2)._replace(logprobs=lp(102, -0.125)))) is None
    report = held.offer(step(4, tok("a", 3)._replace(logprobs=lp(103, -1.5))))
    assert report is not None
    [merged] = report.tokens
    assert merged.logprobs == lp(101, -0.25).then(lp(102, -0.125)).then(lp(103, -1.5))
    assert merged.prompt_logprobs is None  # it went with the first token
    assert first.then(tok("a", 1)._replace(logprobs=lp(101, -0.25))).prompt_logprobs == prompt


@pytest.mark.parametrize(
    "urgent",
    [
        step(3, tok("a", 2), finished=(FinishOut("b", FinishReason.LENGTH),)),
        step(3, tok("a", 2), preempted=("b",)),
        step(3, tok("a", 2), rejected=(FinishOut("c", FinishReason.NONE),)),
        step(3, tok("a", 2), plan_seq=2),  # a new plan's acknowledgement
        step(3, tok("a", 2), pending_prefill_tokens=40),  # the scheduler grants each chunk
        step(3, tok("a", 2), tok("c", 0)),  # c's first token: its time to first token
        step(3),  # nothing decoded: a plan applied while idle
    ],
    ids=["finish", "preempt", "reject", "plan", "prefill", "first-token", "no-tokens"],
)
def test_what_the_scheduler_must_act_on_goes_at_once_with_what_was_held(urgent: StepOutput) -> None:
    held = started(every=8)
    assert held.offer(step(2, tok("a", 1), tok("b", 1))) is None
    report = held.offer(urgent)
    assert report is not None
    assert report.finished == urgent.finished and report.preempted == urgent.preempted
    assert report.plan_seq == urgent.plan_seq
    assert report.tokens[0] == TokenOut("a", (101, 102), "t1t2", 1) or not urgent.tokens


def test_a_request_back_after_a_preemption_counts_as_new() -> None:
    held = started(every=8)
    assert held.offer(step(2, tok("a", 1), preempted=("b",))) is not None
    assert held.offer(step(3, tok("a", 2), tok("b", 0))) is not None


def test_held_tokens_wait_no_longer_than_the_cap() -> None:
    now = [0.0]
    held = started(every=100, wait_ms=20.0, clock=now)
    now[0] = 0.005
    assert held.offer(step(2, tok("a", 1))) is None
    now[0] = 0.024
    assert held.offer(step(3, tok("a", 2))) is None  # 19 ms since the first held step
    now[0] = 0.026
    report = held.offer(step(4, tok("a", 3)))
    assert report is not None and report.tokens[0].token_ids == (101, 102, 103)


def test_first_tokens_at_once_then_every_n_and_the_rest_on_finish() -> None:
    held = TokenBatcher(1, 1000.0)
    held.admitted("r", StreamInterval(tokens=4))
    outs = [
        held.offer(step(i + 1, tok("r", i), finished=(FinishOut("r", FinishReason.LENGTH),) if i == 9 else ()))
        for i in range(10)
    ]
    # token 0 at once; 1-4 as one chunk; 5-8 as one; 9 alone with the finish.
    assert [sizes(o).get("r", 0) for o in outs] == [1, 0, 0, 0, 4, 0, 0, 0, 4, 1]
    assert [o is None for o in outs] == [False, True, True, True, False, True, True, True, False, False]


def test_each_request_keeps_its_own_chunks_whatever_its_neighbours_do() -> None:
    held = TokenBatcher(1, 1000.0)
    held.admitted("coarse", StreamInterval(tokens=4))
    held.admitted("fine", StreamInterval(tokens=1))  # not coarser than every token: nothing to remember
    outs = [held.offer(step(i + 1, tok("coarse", i), tok("fine", i))) for i in range(9)]
    assert [sizes(o) for o in outs] == [
        {"coarse": 1, "fine": 1},
        {"fine": 1},
        {"fine": 1},
        {"fine": 1},
        {"coarse": 4, "fine": 1},
        {"fine": 1},
        {"fine": 1},
        {"fine": 1},
        {"coarse": 4, "fine": 1},
    ]


def test_requests_whose_clients_take_chunks_hold_reports_that_many_steps() -> None:
    held = TokenBatcher(1, 1000.0)
    held.admitted("a", StreamInterval(3))
    held.admitted("b", StreamInterval(3))
    assert held.offer(step(1, tok("a", 0), tok("b", 0))) is not None  # first tokens: at once
    assert held.offer(step(2, tok("a", 1), tok("b", 1))) is None
    assert held.offer(step(3, tok("a", 2), tok("b", 2))) is None
    report = held.offer(step(4, tok("a", 3), tok("b", 3)))
    assert report is not None and report.tokens[0].token_ids == (101, 102, 103)


def test_a_chunk_never_waits_past_its_time_bound() -> None:
    now = [0.0]
    held = TokenBatcher(1, 1000.0, clock=lambda: now[0])
    held.admitted("r", StreamInterval(tokens=100, ms=50))
    assert sizes(held.offer(step(1, tok("r", 0)))) == {"r": 1}
    now[0] = 1.0
    assert held.offer(step(2, tok("r", 1))) is None
    now[0] = 1.049
    assert held.offer(step(3, tok("r", 2))) is None
    now[0] = 1.05
    report = held.offer(step(4, tok("r", 3)))
    assert report is not None and report.tokens == (TokenOut("r", (101, 102, 103), "t1t2t3", 1),)


def test_a_hand_back_carries_everything_held_and_the_request_restarts_fresh() -> None:
    held = TokenBatcher(1, 1000.0)
    held.admitted("r", StreamInterval(tokens=8))
    held.offer(step(1, tok("r", 0)))
    assert held.offer(step(2, tok("r", 1))) is None
    report = held.offer(step(3, tok("r", 2), preempted=("r",)))
    assert report is not None and report.preempted == ("r",)
    assert report.tokens == (TokenOut("r", (101, 102), "t1t2", 1),)  # recorded before the hand-back
    out = step(4, tok("r", 3))  # re-admitted later with a finer interval: per step, nothing held
    assert held.offer(out) is out


def test_one_request_streaming_token_by_token_brings_back_a_report_per_step() -> None:
    held = TokenBatcher(1, 1000.0)
    held.admitted("a", StreamInterval(8))
    held.admitted("b", StreamInterval(1))
    assert held.offer(step(1, tok("a", 0), tok("b", 0))) is not None
    assert held.offer(step(2, tok("a", 1), tok("b", 1))) is not None
    assert held.offer(step(3, tok("a", 2), tok("b", 2), finished=(FinishOut("b", FinishReason.LENGTH),))) is not None
    assert held.offer(step(4, tok("a", 3))) is None  # b is gone: a alone may wait


def test_a_request_that_left_no_longer_holds_reports() -> None:
    held = TokenBatcher(1, 1000.0)
    held.admitted("a", StreamInterval(8))
    assert held.offer(step(1, tok("a", 0), finished=(FinishOut("a", FinishReason.LENGTH),))) is not None
    out = step(2, tok("c", 0))
    assert held.offer(out) is out  # back on the per-step path, nothing kept for a
    held.admitted("d", StreamInterval(8))
    held.forget("d")  # aborted before it ran
    out = step(3, tok("c", 1))
    assert held.offer(out) is out


def test_an_abort_while_steps_are_held_sends_them_in_order_with_the_next_step() -> None:
    held = TokenBatcher(1, 1000.0)
    held.admitted("a", StreamInterval(8))
    assert held.offer(step(1, tok("a", 0))) is not None
    assert held.offer(step(2, tok("a", 1))) is None
    held.forget("a")  # the plan reader, while the engine steps on
    report = held.offer(step(3, tok("a", 2)))
    assert report is not None and report.tokens == (TokenOut("a", (101, 102), "t1t2", 1),)
    out = step(4, finished=(FinishOut("a", FinishReason.CANCELLED),))
    assert held.offer(out) is out  # nothing held any more: the per-step path again


def test_a_re_admission_drops_what_its_run_before_held_and_reports_its_first_tokens_at_once() -> None:
    held = TokenBatcher(1, 1000.0)
    held.admitted("a", StreamInterval(8))
    assert held.offer(step(1, tok("a", 0))) is not None
    assert held.offer(step(2, tok("a", 1))) is None
    assert held.offer(step(3, tok("a", 2))) is None  # 1 and 2 held, never reported
    held.admitted("a", StreamInterval(8))  # re-admitted from the one token Redis recorded
    report = held.offer(step(4, tok("a", 1), plan_seq=2))
    assert report is not None and report.tokens == (tok("a", 1),)


def test_random_steps_reassemble_exactly() -> None:
    rng = random.Random(7)
    now = [0.0]
    for trial in range(50):
        held = TokenBatcher(rng.choice([1, 1, 3]), rng.choice([5.0, 1000.0]), clock=lambda: now[0])
        intervals = {f"r{k}": StreamInterval(rng.randrange(1, 10), rng.choice([0, 0, 5])) for k in range(4)}
        for rid, interval in intervals.items():
            held.admitted(rid, interval)
        made: dict[str, list[int]] = {rid: [] for rid in intervals}
        got: dict[str, list[TokenOut]] = {rid: [] for rid in intervals}
        for i in range(60):
            now[0] += rng.random() * 0.004
            tokens = []
            for rid in intervals:
                if rng.random() < 0.3:
                    continue
                ids = tuple(rng.randrange(100) for _ in range(rng.randrange(1, 3)))
                tokens.append(TokenOut(rid, ids, "", len(made[rid])))
                made[rid].extend(ids)
            report = held.offer(step(i + 1, *tokens))
            for t in report.tokens if report is not None else ():
                got[t.request_id].append(t)
        final = held.offer(step(61, finished=tuple(FinishOut(rid, FinishReason.LENGTH) for rid in intervals)))
        assert final is not None
        for t in final.tokens:
            got[t.request_id].append(t)
        for rid, chunks in got.items():
            flat: list[int] = []
            for chunk in chunks:
                assert chunk.output_index == len(flat), f"trial {trial}, {rid}: a chunk must start where the last ended"
                flat.extend(chunk.token_ids)
            assert flat == made[rid], f"trial {trial}, {rid}"


def test_prefix_cache_events_of_held_steps_go_with_the_next_report() -> None:
    held = started(every=3)
    assert held.offer(step(2, tok("a", 1), kv_events=KvCacheEvents(stored=(1, 2)))) is None
    assert held.offer(step(3, tok("a", 2), kv_events=KvCacheEvents(stored=(3,), removed=(1,)))) is None
    report = held.offer(step(4, tok("a", 3), kv_events=KvCacheEvents(removed=(9,)), prefix_cache_hits=7))
    assert report is not None and report.prefix_cache_hits == 7
    assert report.kv_events == KvCacheEvents(stored=(2, 3), removed=(1, 9))
    assert held.offer(step(5, tok("a", 4))) is None
    assert held.offer(step(6, tok("a", 5))) is None
    report = held.offer(step(7, tok("a", 6)))
    assert report is not None and not report.kv_events  # nothing carried twice


def test_merged_prefix_cache_events_keep_the_latest_change_and_a_clear() -> None:
    first = KvCacheEvents(cleared=True, stored=(1, 2, 3))
    later = KvCacheEvents(stored=(4, 1), removed=(2,))
    assert first.then(later) == KvCacheEvents(cleared=True, stored=(3, 4, 1), removed=(2,))
    assert later.then(KvCacheEvents(stored=(2,), removed=(4,))) == KvCacheEvents(stored=(1, 2), removed=(4,))
    assert later.then(first) == first  # a clear restates everything
    assert not KvCacheEvents() and KvCacheEvents().then(later) == later and later.then(KvCacheEvents()) == later


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="every_steps"):
        TokenBatcher(0, 50.0)
    with pytest.raises(ValueError):
        StreamInterval(tokens=0)
    with pytest.raises(ValueError):
        StreamInterval(tokens=2, ms=-1)


@pytest.fixture
async def coalescing_stack(redis_url: str, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    running = await start_stack(stack_config(redis_url, tiny_model_dir, executor={"report_every_steps": 4}))
    yield running
    await running.stop()


@pytest.fixture
async def plain_stack(redis_url: str, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    running = await start_stack(stack_config(redis_url, tiny_model_dir))
    yield running
    await running.stop()


async def test_greedy_outputs_match_generate_with_reports_merged(coalescing_stack: Stack, tiny_model_dir: Path) -> None:
    await assert_greedy_matches_generate(coalescing_stack, tiny_model_dir, stream_interval=1)


async def test_greedy_outputs_match_generate_with_reports_held_for_the_clients_chunks(
    plain_stack: Stack, tiny_model_dir: Path
) -> None:
    """The executor's default (a report per step), raised by the requests' own stream intervals."""
    await assert_greedy_matches_generate(plain_stack, tiny_model_dir, stream_interval=5)


async def assert_greedy_matches_generate(stack: Stack, tiny_model_dir: Path, stream_interval: int) -> None:
    rng = random.Random(21)
    prompts = [[1] + [rng.randrange(5, 8000) for _ in range(rng.randrange(4, 120))] for _ in range(10)]
    lengths = [rng.randrange(6, 40) for _ in prompts]

    async def one(i: int) -> list[pb.GenerateResponse]:
        await asyncio.sleep(0.02 * i)  # join and leave a running batch at different moments
        params = pb.SamplingParams(max_tokens=lengths[i], ignore_eos=True, stream_interval_tokens=stream_interval)
        return await stack.generate(pb.GenerateRequest(prompt_token_ids=prompts[i], params=params))

    results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    reference_model = load_reference_model(tiny_model_dir)
    for i, chunks in enumerate(results):
        expected = reference_greedy(reference_model, prompts[i], lengths[i])
        assert_matches_reference(joined_tokens(chunks), expected, f"prompt {i}")
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert [c.index for c in chunks] == sorted(c.index for c in chunks)
    # Far fewer step reports reached the scheduler than the executor ran steps: plain decode steps
    # were merged (about 0.45 reports a step measured; 0.95 with every step reported).
    registry = stack.scheduler.dispatcher.metrics.registry
    links = stack.scheduler.dispatcher.links.values()
    reports = sum(
        registry.get_sample_value("baton:step_time_seconds_count", {"executor": lk.executor_id}) or 0 for lk in links
    )
    assert 0 < reports < 0.7 * sum(link.iteration for link in links)
