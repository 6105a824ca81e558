"""Automatic prefix caching on the generated tiny model: a request that starts from cached blocks
generates exactly what ``model.generate`` gives on its prompt alone, whatever part of it was cached."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import cast

import grpc
import pytest

from common.block_hashing import chain_root
from common.pb import executor_pb2, executor_pb2_grpc
from common.pb import generate_pb2 as gen_pb
from common.sampling_params import SamplingParams
from executor_service.block_allocator import BlockAllocator
from executor_service.convert import report_to_pb
from executor_service.detokenizer import IncrementalDetokenizer
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, KvCacheEvents, PlanUpdate
from executor_service.load_metrics import DeviceLoad
from executor_service.prefix_cache import PrefixCache
from executor_service.sequence import Sequence
from executor_service.step_scheduler import StepPlan, StepScheduler
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.executor_service.test_engine import admit, make_engine, run_to_end
from tests.stack import Stack, eventually, joined_tokens, stack_config, start_stack

BLOCK = 16


def random_tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 8000) for _ in range(count)]


class Checker:
    """Runs requests one plan at a time and checks each against ``model.generate``."""

    def __init__(self, engine: Engine, model_dir: Path) -> None:
        self.engine = engine
        self.model = load_reference_model(model_dir)
        self.count = 0
        self.events = KvCacheEvents()  # since the last take_events
        self.first_token_step: dict[str, int] = {}  # the last run's: the step each request's first token came in
        self.cached: dict[str, int] = {}  # the last run's: the tokens each request reported taken from the cache

    def run(self, prompts: list[list[int]], max_tokens: int = 10) -> dict[str, list[int]]:
        specs = []
        for prompt in prompts:
            self.count += 1
            specs.append(admit(f"q{self.count}", prompt, max_tokens))
        self.engine.apply(PlanUpdate(seq=self.count, admit=tuple(specs)))
        outputs: dict[str, list[int]] = {spec.request_id: [] for spec in specs}
        self.first_token_step, self.cached = {}, {}
        step = 0
        while self.engine.has_work:
            out = self.engine.step()
            self.events = self.events.then(out.kv_events)
            for delta in out.tokens:
                # Its first output, and only that, says what its prefill took from the cache.
                assert (delta.num_cached is not None) == (not outputs[delta.request_id]), delta
                if delta.num_cached is not None:
                    self.cached[delta.request_id] = delta.num_cached
                outputs[delta.request_id] += delta.token_ids
                self.first_token_step.setdefault(delta.request_id, step)
            step += 1
        for spec, prompt in zip(specs, prompts, strict=True):
            ref = reference_greedy(self.model, prompt, max_tokens)
            assert_matches_reference(outputs[spec.request_id], ref, f"{spec.request_id} ({len(prompt)} tokens)")
        return outputs

    def take_events(self) -> KvCacheEvents:
        events, self.events = self.events.then(self.engine.drain().kv_events), KvCacheEvents()
        return events

    def hits_of(self, prompts: list[list[int]], max_tokens: int = 10) -> int:
        """The run's hits in tokens, which its requests' own reports add up to."""
        before = self.engine.prefix_cache.hits
        self.run(prompts, max_tokens)
        hits = self.engine.prefix_cache.hits - before
        assert sum(self.cached.values()) == hits, self.cached
        return hits


@pytest.mark.parametrize(("backend", "native_prefill"), [("auto", True), ("auto", False), ("torch", False)])
def test_shared_prefixes_of_every_kind_match_generate(tiny_model_dir: Path, backend: str, native_prefill: bool) -> None:
    """``torch``: transformers' forward and plain torch attention read the shared blocks. ``auto``
    reads prompt chunks through the native prefill kernel where the CPU has AVX-512, or AVX2 and
    FMA, and else (or asked not to) gathers their cached blocks for SDPA."""
    engine = make_engine(tiny_model_dir, block_size=BLOCK, backend=backend)
    if native_prefill and not engine.runner.native_prefill:
        pytest.skip("no native prefill kernel here (it needs AVX-512, or AVX2 and FMA)")
    engine.runner.native_prefill = native_prefill
    check = Checker(engine, tiny_model_dir)
    base = [1, *random_tokens(149, seed=1)]  # 150 tokens: 9 full blocks and a partial one
    assert check.hits_of([base]) == 0
    assert engine.allocator.num_cached >= 9
    # A prefix ending mid-block: only the full blocks before it are reused.
    for shared in (5, 16, 23, 40, 100, 149):
        prompt = base[:shared] + random_tokens(30, seed=shared)
        assert check.hits_of([prompt]) == (shared // BLOCK) * BLOCK, shared
    # The same prompt again (not block-aligned): everything cached but its partial block.
    assert check.hits_of([base]) == 9 * BLOCK
    # A block-aligned prompt seen before: every block but the last, whose last token gives the logits.
    aligned = [1, *random_tokens(63, seed=2)]
    check.run([aligned])
    assert check.hits_of([aligned]) == 3 * BLOCK
    # One token past a block boundary: only the last token is computed, as a decode would be.
    one_past = [1, *random_tokens(32, seed=4)]
    check.run([one_past])
    assert check.hits_of([one_past]) == 2 * BLOCK
    # The conversation goes on: the prompt and the first answer become the next prompt, whose
    # blocks holding generated tokens were named as they filled.
    answer = check.run([base], max_tokens=40)
    follow_up = base + next(iter(answer.values())) + random_tokens(7, seed=3)
    assert check.hits_of([follow_up]) == ((150 + 40 - 1) // BLOCK) * BLOCK
    out = engine.drain()
    assert out.prefix_cache_hits == engine.prefix_cache.hits > 0
    assert out.prefix_cache_queries == engine.prefix_cache.queries
    assert engine.allocator.num_free == engine.allocator.num_blocks  # no block leaked


def test_a_prefix_evicted_under_memory_pressure_is_recomputed_exactly(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, kv_cache_memory_mb=1, block_size=BLOCK, token_budget=512)
    allocator = engine.allocator
    check = Checker(engine, tiny_model_dir)
    first = [1, *random_tokens(99, seed=4)]
    check.run([first])
    first_names = set(allocator.cached_names())
    check.take_events()  # those so far
    removed: set[int] = set()
    seed = 5
    while not first_names <= removed:  # other prompts, until every block of the first is evicted
        seed += 1
        check.run([[1, *random_tokens(allocator.num_blocks * BLOCK // 3, seed=seed)]], max_tokens=4)
        removed |= set(check.take_events().removed)
        assert seed < 40, "the first prompt's blocks were never evicted"
    assert check.hits_of([first]) == 0  # recomputed from scratch
    assert check.hits_of([[*first, 7, 8, 9]]) == 6 * BLOCK  # and cached again
    assert allocator.num_free == allocator.num_blocks


def test_requests_on_the_same_new_prefix_in_one_step_match_generate(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, block_size=BLOCK, token_budget=512)
    check = Checker(engine, tiny_model_dir)
    prefix = [1, *random_tokens(79, seed=6)]
    together = [prefix + random_tokens(5 + 7 * i, seed=10 + i) for i in range(3)] + [list(prefix)]
    # All admitted before any of them computed the prefix: the first computes it, and the others start
    # from its 5 blocks (the bare prefix, 80 tokens, from 4: its last one is computed) in the same step,
    # reading the blocks that the first fills in that forward pass.
    assert check.hits_of(together) == 2 * 5 * BLOCK + 4 * BLOCK
    assert sorted(check.cached.values()) == [0, 4 * BLOCK, 5 * BLOCK, 5 * BLOCK]
    assert set(check.first_token_step.values()) == {0}, check.first_token_step
    stored = check.take_events().stored
    assert len(stored) == len(set(stored)) == len(engine.allocator.cached_names())
    assert check.hits_of([[*prefix, 3, 4]]) == 5 * BLOCK
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_block_a_chunk_ahead_only_begins_is_waited_for_then_shared(tiny_model_dir: Path) -> None:
    """The first request's grant ends inside its third block: the second takes the two blocks filled in
    that step, waits for the third, and takes it and the rest in the step that completes them."""
    engine = make_engine(tiny_model_dir, block_size=BLOCK, token_budget=512)
    model = load_reference_model(tiny_model_dir)
    prefix = [1, *random_tokens(79, seed=41)]  # 5 blocks
    first, second = prefix + random_tokens(6, seed=42), prefix + random_tokens(9, seed=43)
    specs = (admit("first", first, 8), admit("second", second, 8))
    engine.apply(PlanUpdate(seq=1, admit=specs, grants={"first": 40}))
    outputs: dict[str, list[int]] = {"first": [], "second": []}
    out = engine.step()
    assert not out.tokens
    leader, follower = engine.running["first"], engine.running["second"]
    assert leader.num_computed == 40
    assert follower.block_table == leader.block_table[:2] and follower.num_computed == 2 * BLOCK
    first_steps: dict[str, int] = {}
    for step in range(1, 20):
        for delta in engine.step().tokens:
            outputs[delta.request_id] += delta.token_ids
            first_steps.setdefault(delta.request_id, step)
        if not engine.has_work:
            break
    assert first_steps == {"first": 1, "second": 1}
    assert engine.prefix_cache.hits == 5 * BLOCK
    for name, prompt in (("first", first), ("second", second)):
        assert_matches_reference(outputs[name], reference_greedy(model, prompt, 8), name)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_grant_covers_the_expected_cached_prefix_the_cache_no_longer_holds(tiny_model_dir: Path) -> None:
    """The scheduler granted only what follows a prefix its index named, but the executor evicted
    that prefix since: it computes the prefix too in the same step, so the first token is not late."""
    engine = make_engine(tiny_model_dir, block_size=BLOCK, token_budget=512)
    prompt = [1, *random_tokens(69, seed=51)]  # 4 full blocks and 6 tokens
    expected = {"r": 4 * BLOCK}
    engine.apply(PlanUpdate(seq=1, admit=(admit("r", prompt, 4),), grants={"r": 6}, expected_cached=expected))
    assert engine.running["r"].num_cached == 0
    outputs: list[int] = []
    first_token_step = None
    for step in range(20):
        outputs += [token for delta in engine.step().tokens for token in delta.token_ids]
        if outputs and first_token_step is None:
            first_token_step = step
        if not engine.has_work:
            break
    assert first_token_step == 0
    assert_matches_reference(outputs, reference_greedy(load_reference_model(tiny_model_dir), prompt, 4), "r")


def test_a_burst_on_one_new_prefix_computes_it_once_even_across_chunks(tiny_model_dir: Path) -> None:
    """A prefix longer than a step's budget: the first request computes it chunk by chunk, and the
    others, admitted with it, each take every block as it is named instead of computing it too."""
    engine = make_engine(tiny_model_dir, block_size=BLOCK, token_budget=48)
    check = Checker(engine, tiny_model_dir)
    prefix = [1, *random_tokens(159, seed=21)]  # 10 blocks, more than three steps' budget
    burst = [prefix + random_tokens(3 + i, seed=30 + i) for i in range(4)]
    hits = check.hits_of(burst, max_tokens=6)
    assert hits == 3 * 10 * BLOCK  # everyone but the first started from all ten blocks
    assert sorted(check.cached.values()) == [0, 10 * BLOCK, 10 * BLOCK, 10 * BLOCK]
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_preempted_request_resumes_from_its_cached_blocks(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, block_size=BLOCK)
    model = load_reference_model(tiny_model_dir)
    prompt = [1, *random_tokens(70, seed=7)]
    ref = reference_greedy(model, prompt, 30)
    engine.apply(PlanUpdate(seq=1, admit=(admit("p", prompt, 30),)))
    got: list[int] = []
    while len(got) < 12:
        got += [t for d in engine.step().tokens for t in d.token_ids]
    engine.apply(PlanUpdate(seq=2, preempt=("p",)))
    assert engine.drain().preempted == ("p",) and engine.allocator.num_used == 0
    hits = engine.prefix_cache.hits
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.apply(PlanUpdate(seq=3, admit=(AdmitSpec("p", tuple(prompt), tuple(got), params, 0.0),)))
    resumed = engine.step().tokens
    # The resumed admission's first output reports its own hits, its output so far included.
    assert [d.num_cached for d in resumed] == [((len(prompt) + len(got) - 1) // BLOCK) * BLOCK]
    rest = [t for d in resumed for t in d.token_ids]
    while engine.has_work:
        rest += [t for d in engine.step().tokens for t in d.token_ids]
    assert engine.prefix_cache.hits == hits  # what it took was its own output, not a client's prompt
    assert_matches_reference(got + rest, ref, "resumed")


def test_a_request_preempted_for_blocks_resumes_exactly(tiny_model_dir: Path) -> None:
    """Out of blocks, the engine hands back the least important request; re-admitted, it starts
    from whatever of its blocks survived."""
    engine = make_engine(tiny_model_dir, kv_cache_memory_mb=1, block_size=BLOCK, token_budget=512)
    model = load_reference_model(tiny_model_dir)
    prompt_len = (engine.allocator.num_blocks // 2) * BLOCK - 4
    prompts = {"important": [1, *random_tokens(prompt_len - 1, 8)], "victim": [1, *random_tokens(prompt_len - 1, 9)]}
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    engine.apply(
        PlanUpdate(
            seq=1, admit=tuple(AdmitSpec(r, tuple(p), (), params, i) for i, (r, p) in enumerate(prompts.items()))
        )
    )
    outputs: dict[str, list[int]] = {"important": [], "victim": []}
    done: set[str] = set()
    resumed = False
    seq = 1
    for _ in range(2000):
        if done == set(prompts):
            break
        out = engine.step() if engine.has_work else engine.drain()
        for delta in out.tokens:
            outputs[delta.request_id] += delta.token_ids
        done |= {f.request_id for f in out.finished}
        for request_id in out.preempted:
            seq += 1
            resumed = True
            again = AdmitSpec(request_id, tuple(prompts[request_id]), tuple(outputs[request_id]), params, 1)
            engine.apply(PlanUpdate(seq=seq, admit=(again,)))
    assert resumed
    for request_id, prompt in prompts.items():
        assert_matches_reference(outputs[request_id], reference_greedy(model, prompt, 48), request_id)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_cache_salt_shares_blocks_only_with_requests_of_the_same_salt(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, block_size=BLOCK)
    prompt = [1, *random_tokens(60, seed=14)]  # 3 full blocks before its last token
    ref = reference_greedy(load_reference_model(tiny_model_dir), prompt, 6)

    def hits_of(request_id: str, salt: str) -> int:
        before = engine.prefix_cache.hits
        spec = replace(admit(request_id, prompt, 6), prefix_root=chain_root(salt))
        assert_matches_reference(run_to_end(engine, {0: [spec]})[request_id], ref, request_id)
        return engine.prefix_cache.hits - before

    salts = ["a", "b", "", "a", "b", ""]
    assert [hits_of(f"r{i}", salt) for i, salt in enumerate(salts)] == [0, 0, 0] + [3 * BLOCK] * 3
    names = engine.allocator.cached_names()
    assert len(names) == len(set(names)) == 3 * 4  # each salt's chain of the 4 blocks the first request filled


def test_prefix_caching_off_reuses_nothing(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, block_size=BLOCK, prefix_caching=False)
    check = Checker(engine, tiny_model_dir)
    prompt = [1, *random_tokens(60, seed=11)]
    check.run([prompt])
    assert check.hits_of([prompt]) == 0
    assert not check.take_events() and engine.allocator.num_cached == 0 and engine.allocator.cached_names() == ()


def test_reports_carry_the_events_and_counters(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, block_size=BLOCK)
    prompt = [1, *random_tokens(40, seed=12)]
    run_to_end(engine, {0: [admit("a", prompt, 2)]})
    names = engine.allocator.cached_names()
    engine.apply(PlanUpdate(seq=2, admit=(admit("b", prompt, 2),)))
    report = report_to_pb(engine.step(), DeviceLoad("cpu", 0.0, 0, 0, 0.0))
    assert report.load.prefix_cache_queries == 2 * len(prompt)
    assert report.load.prefix_cache_hits == 2 * BLOCK
    assert not report.HasField("kv_events")  # nothing new was named
    empty = report_to_pb(engine.drain(), DeviceLoad("cpu", 0.0, 0, 0, 0.0))
    assert not empty.HasField("kv_events")
    assert len(names) == 2


@pytest.fixture
async def cached_stack(redis_url: str, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    running = await start_stack(stack_config(redis_url, tiny_model_dir, executor={"block_size": BLOCK}))
    yield running
    await running.stop()


async def test_repeated_prompts_through_a_stack_hit_the_cache_and_match_generate(
    cached_stack: Stack, tiny_model_dir: Path
) -> None:
    shared = [1, *random_tokens(60, seed=13)]
    prompts = [shared + random_tokens(3 + i, seed=20 + i) for i in range(3)] + [shared, shared]
    metrics = cached_stack.executors[0].metrics.registry
    assert metrics.get_sample_value("baton:prefix_cache_hits_total") == 0
    results = []
    for prompt in prompts:  # one after another, so each finds what the ones before left
        params = gen_pb.SamplingParams(max_tokens=8, ignore_eos=True)
        results.append(await cached_stack.generate(gen_pb.GenerateRequest(prompt_token_ids=prompt, params=params)))
    model = load_reference_model(tiny_model_dir)
    for i, (prompt, chunks) in enumerate(zip(prompts, results, strict=True)):
        assert_matches_reference(joined_tokens(chunks), reference_greedy(model, prompt, 8), f"prompt {i}")
    # Each client's usage says how much of its prompt was read from the cache: the shared 3 blocks.
    assert [chunks[-1].usage.cached_tokens for chunks in results] == [0] + [3 * BLOCK] * (len(prompts) - 1)
    want_hits, want_queries = 3 * BLOCK * (len(prompts) - 1), sum(len(p) for p in prompts)

    def counted() -> bool:  # the last step's metrics are observed on the engine thread
        hits, queries = (metrics.get_sample_value(f"baton:prefix_cache_{n}_total") for n in ("hits", "queries"))
        return (hits or 0) >= want_hits and (queries or 0) >= want_queries

    await eventually(counted, "the prefix-cache counters")
    hits = metrics.get_sample_value("baton:prefix_cache_hits_total")
    queries = metrics.get_sample_value("baton:prefix_cache_queries_total")
    assert hits is not None and queries is not None
    assert hits >= 3 * BLOCK * (len(prompts) - 1) and queries >= sum(len(p) for p in prompts)
    async with grpc.aio.insecure_channel(cached_stack.executors[0].address) as channel:
        info = await executor_pb2_grpc.ExecutorStub(channel).Info(executor_pb2.InfoRequest(), timeout=10)
    assert info.prefix_caching


async def test_a_salted_request_through_a_stack_reads_only_its_salts_blocks(cached_stack: Stack) -> None:
    prompt = [1, *random_tokens(60, seed=15)]
    cached = []
    for salt in ("tenant-a", "tenant-b", "", "tenant-a", ""):
        params = gen_pb.SamplingParams(max_tokens=4, ignore_eos=True)
        request = gen_pb.GenerateRequest(prompt_token_ids=prompt, params=params, cache_salt=salt)
        cached.append((await cached_stack.generate(request))[-1].usage.cached_tokens)
    assert cached == [0, 0, 0, 3 * BLOCK, 3 * BLOCK]


# ---- the step's sharing rule alone: sequences and the allocator's bookkeeping, no model ------------
def _sequence(request_id: str, tokens: list[int], rank: float) -> Sequence:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Sequence(request_id, list(tokens), [], params, rank, None, cast(IncrementalDetokenizer, None))


def _plan(cache: PrefixCache, seqs: list[Sequence], budget: int = 1024) -> StepPlan[Sequence]:
    """One step's plan for ``seqs``, in rank order; those without blocks match the cache first."""
    for seq in seqs:
        if not seq.block_table:
            cache.match(seq)
    scheduler: StepScheduler[Sequence] = StepScheduler(cache.allocator, lambda seq: None)
    sharing = cache.sharing()
    assert sharing is not None
    return scheduler.schedule(seqs, budget, {}, sharing.may_compute)


def test_followers_take_only_the_blocks_a_chunk_ahead_fills_and_that_their_own_tokens_name() -> None:
    cache = PrefixCache(BlockAllocator(64, 4))
    prefix = list(range(1, 13))  # 3 blocks of 4
    filler = _sequence("filler", [*prefix, 50, 51], 0.0)
    follower = _sequence("follower", [*prefix, 60], 1.0)
    diverging = _sequence("diverging", [*prefix[:6], 70, 71, 72, 73, 74, 75, 76], 2.0)  # shares block 0 only
    plan = _plan(cache, [filler, follower, diverging])
    planned = [(c.seq.request_id, c.num_tokens) for c in plan.chunks]
    assert planned == [("filler", 14), ("follower", 1), ("diverging", 9)]
    assert follower.block_table[:3] == filler.block_table[:3] and follower.num_computed == 12
    assert diverging.block_table[0] == filler.block_table[0] and diverging.block_table[1] != filler.block_table[1]
    assert diverging.num_computed == 4
    assert cache.hits == 12 + 4


def test_the_hit_counters_count_new_requests_prompts_not_a_resumed_requests_own_output() -> None:
    cache = PrefixCache(BlockAllocator(64, 4))
    prompt = list(range(1, 13))  # 3 blocks of 4
    first = _sequence("first", prompt, 0.0)
    resumed = _sequence("resumed", prompt[:6], 1.0)  # preempted after 6 tokens of output: it re-prefills
    resumed.output_ids = prompt[6:]
    again = _sequence("again", [*prompt, 99], 2.0)
    _plan(cache, [first, resumed, again])
    assert resumed.num_computed == 8 and again.num_computed == 12  # both take the blocks first fills...
    assert (cache.queries, cache.hits) == (12 + 13, 12)  # ...and only the new request's prompt counts


def test_a_block_being_begun_or_claimed_is_waited_for() -> None:
    cache = PrefixCache(BlockAllocator(64, 4))
    prefix = list(range(1, 17))  # 4 blocks
    filler = _sequence("filler", [*prefix, 50], 0.0)
    follower = _sequence("follower", [*prefix, 60], 1.0)
    for seq in (filler, follower):
        cache.match(seq)
    scheduler: StepScheduler[Sequence] = StepScheduler(cache.allocator, lambda seq: None)
    sharing = cache.sharing()
    assert sharing is not None
    plan = scheduler.schedule([filler, follower], 1024, {"filler": 6}, sharing.may_compute)
    # The filler's grant ends inside block 1: the follower takes block 0 and waits for block 1.
    assert [c.seq.request_id for c in plan.chunks] == ["filler"]
    assert follower.block_table == filler.block_table[:1] and follower.num_computed == 4


def test_a_prefill_left_out_of_the_step_holds_up_no_other_on_its_prefix() -> None:
    # Four free blocks of 4 tokens. The long prompt ahead cannot get the blocks for its chunk; the
    # short one behind it on the same new prefix fits, and computes the shared blocks itself.
    allocator = BlockAllocator(16, 4)
    held: list[int] = []
    allocator.grow(held, 48)  # 12 blocks held by a sequence that is not in this step
    prefix = list(range(1, 13))  # 3 blocks
    long = _sequence("long", [*prefix, *range(100, 140)], 0.0)
    short = _sequence("short", [*prefix, 200], 1.0)
    plan = _plan(PrefixCache(allocator), [long, short])
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("short", 13)]
    assert plan.preempted == () and long.block_table == []


def test_a_decode_filling_a_block_shares_nothing_before_it_is_named() -> None:
    cache = PrefixCache(BlockAllocator(64, 4))
    decoding = _sequence("decoding", [1, 2, 3], 0.0)
    cache.match(decoding)
    cache.allocator.grow(decoding.block_table, 4)
    decoding.output_ids.append(4)
    decoding.num_computed = 3  # its output token, which fills block 0, is computed this step
    other = _sequence("other", [1, 2, 3, 4, 8], 1.0)
    plan = _plan(cache, [decoding, other])
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("decoding", 1), ("other", 5)]
    assert other.num_computed == 0 and other.block_table[0] != decoding.block_table[0]
