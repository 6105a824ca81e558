"""baton bench's prefix workloads: shared-prefix and multi-turn builders, their figures and flags."""

from __future__ import annotations

import argparse
import math
from collections import Counter

import pytest

from baton.bench import cli as bench_cli
from baton.bench.multi_turn import MultiTurnSpec, turn_prompt
from baton.bench.prefix_scenarios import PREFIX_SCENARIOS
from baton.bench.report import ScenarioResult, scenario_table, turn_table
from baton.bench.reuse import prefix_reuse, ttft_by_turn
from baton.bench.shared_prefix import SharedPrefixSpec, firsts_of_groups
from baton.bench.stats import RequestTiming, summarize
from baton.bench.workload import BOS, RequestSpec


def test_shared_prefix_groups_really_share_their_system_prompt() -> None:
    spec = SharedPrefixSpec(num_groups=4, prompts_per_group=5, system_prompt_len=40, question_len=(3, 9), seed=2)
    specs = spec.build()
    assert len(specs) == spec.num_requests == 20
    assert Counter(s.group for s in specs) == {g: 5 for g in range(4)}
    systems: dict[int, set[tuple[int, ...]]] = {}
    for s in specs:
        assert s.prompt_ids[0] == BOS and s.group is not None
        assert 40 + 3 <= len(s.prompt_ids) <= 40 + 9 and 32 <= s.output_len <= 96
        systems.setdefault(s.group, set()).add(s.prompt_ids[:40])
    assert all(len(prefixes) == 1 for prefixes in systems.values()), "one system prompt per group"
    assert len({next(iter(p)) for p in systems.values()}) == 4, "and a different one for each group"
    # Past the system prompt, the groups share nothing beyond chance: the first question tokens differ.
    assert len({s.prompt_ids[40:] for s in specs}) == 20
    assert spec.input_len == (43, 49)


def test_shared_prefix_is_deterministic_and_the_order_only_reorders() -> None:
    spec = SharedPrefixSpec(num_groups=3, prompts_per_group=4, system_prompt_len=16, seed=5)
    shuffled = spec.build()
    assert shuffled == spec.build()
    assert SharedPrefixSpec(num_groups=3, prompts_per_group=4, system_prompt_len=16, seed=6).build() != shuffled
    grouped = SharedPrefixSpec(num_groups=3, prompts_per_group=4, system_prompt_len=16, order="grouped", seed=5).build()
    rr = SharedPrefixSpec(num_groups=3, prompts_per_group=4, system_prompt_len=16, order="round-robin", seed=5).build()
    assert sorted(map(hash, shuffled)) == sorted(map(hash, grouped)) == sorted(map(hash, rr))
    assert [s.group for s in grouped] == [0] * 4 + [1] * 4 + [2] * 4
    assert [s.group for s in rr] == [0, 1, 2] * 4
    assert [s.group for s in shuffled] != [s.group for s in grouped]


@pytest.mark.parametrize(
    "bad",
    [dict(num_groups=0), dict(prompts_per_group=0), dict(system_prompt_len=0), dict(question_len=(5, 4)),
     dict(output_len=(0, 3)), dict(order="sorted")],
)  # fmt: skip
def test_shared_prefix_rejects_bad_settings(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SharedPrefixSpec(**bad)  # type: ignore[arg-type]


def test_firsts_of_groups_follow_the_send_order() -> None:
    specs = [RequestSpec((1,), 1, group=g) for g in (2, 0, 2, 1, 0)] + [RequestSpec((1,), 1)]
    assert firsts_of_groups(specs) == [True, True, False, True, False, True]


def test_multi_turn_prompt_is_the_whole_history_and_the_new_message() -> None:
    messages = [(1, 10, 11), (12, 13), (14,)]
    assert turn_prompt(messages, []) == (1, 10, 11)
    assert turn_prompt(messages, [[50, 51]]) == (1, 10, 11, 50, 51, 12, 13)
    assert turn_prompt(messages, [[50, 51], [52]]) == (1, 10, 11, 50, 51, 12, 13, 52, 14)
    with pytest.raises(ValueError):
        turn_prompt(messages, [[1], [2], [3]])


def test_multi_turn_conversations_are_seeded_and_sized() -> None:
    spec = MultiTurnSpec(conversations=3, turns=4, user_len=(5, 9), output_len=(2, 6), seed=1)
    convs = spec.build()
    assert convs == spec.build() and convs != MultiTurnSpec(3, 4, (5, 9), (2, 6), seed=2).build()
    assert len(convs) == 3 and all(c.turns == 4 and len(c.output_lens) == 4 for c in convs)
    for c in convs:
        assert c.messages[0][0] == BOS and all(BOS not in m for m in c.messages[1:])
        assert all(5 <= len(m) <= 9 for m in c.messages) and all(2 <= n <= 6 for n in c.output_lens)
    assert spec.num_requests == 12 and spec.input_len == (5, 4 * 9 + 3 * 6)
    with pytest.raises(ValueError):
        MultiTurnSpec(turns=0)


def _timing(ttft: float, tokens: int = 2, error: str = "") -> RequestTiming:
    return RequestTiming(5, tokens, 0.0, [ttft + 0.01 * i for i in range(tokens)], tokens, error)


def test_prefix_reuse_sets_the_firsts_against_the_repeats() -> None:
    timings = [_timing(0.4), _timing(0.1), _timing(0.3), _timing(0.2), _timing(9.0, error="boom")]
    reuse = prefix_reuse([True, False, False, True, False], timings)
    assert reuse is not None and (reuse.firsts, reuse.repeats) == (2, 2)
    assert reuse.first_ttft_ms == pytest.approx(300) and reuse.repeat_ttft_ms == pytest.approx(200)
    assert reuse.ratio == pytest.approx(2 / 3)
    assert prefix_reuse([True, True], timings[:2]) is None, "no repeats, no figure"
    with pytest.raises(ValueError):
        prefix_reuse([True], timings)


def test_ttft_by_turn_averages_each_turn_index() -> None:
    by_turn = ttft_by_turn([[_timing(0.5), _timing(0.1)], [_timing(0.3), _timing(0.2, error="x")]])
    assert by_turn == pytest.approx((400, 100))
    assert ttft_by_turn([]) == ()
    assert math.isnan(ttft_by_turn([[_timing(0.1, error="x")]])[0])


def test_report_shows_the_reuse_columns_and_the_turn_table() -> None:
    timings = [_timing(0.4), _timing(0.1)]
    reuse = prefix_reuse([True, False], timings)
    plain = ScenarioResult("short", "", 2, (1, 2), (1, 2), summarize(timings, 1.0))
    shared = ScenarioResult("multi-turn", "", 2, (1, 2), (1, 2), summarize(timings, 1.0), reuse, (400.0, 100.0))
    headers = [c.header for c in scenario_table([plain, shared]).columns]
    assert headers[-3:] == ["first TTFT ms", "repeat TTFT ms", "repeat/first"]
    assert "repeat/first" not in [c.header for c in scenario_table([plain]).columns]
    table = turn_table([plain, shared])
    assert table is not None and [c.header for c in table.columns] == ["scenario", "turn 1", "turn 2", "later/turn 1"]
    assert turn_table([plain]) is None


def _parse(argv: list[str]) -> argparse.Namespace:
    from baton.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


def test_prefix_scenarios_run_when_named_and_take_their_flags() -> None:
    assert set(PREFIX_SCENARIOS) == {"shared-prefix", "multi-turn"}
    default = PREFIX_SCENARIOS["shared-prefix"].workload
    assert isinstance(default, SharedPrefixSpec) and default.num_requests == 96
    assert (default.system_prompt_len, default.question_len, default.output_len) == (384, (16, 64), (32, 96))
    argv = ["--scenario", "shared-prefix", "multi-turn", "--seed", "3", "--batch-size", "5"]
    argv += ["--gsp-groups", "2", "--gsp-question-len", "7", "--gsp-output-len", "4", "9", "--gsp-order", "grouped"]
    argv += ["--mt-turns", "3", "--mt-user-len", "6", "--num-requests", "99"]
    sp, mt = bench_cli.scenarios_from(_parse(argv))
    assert isinstance(sp.workload, SharedPrefixSpec) and isinstance(mt.workload, MultiTurnSpec)
    assert (sp.workload.num_groups, sp.workload.question_len, sp.workload.output_len) == (2, (7, 7), (4, 9))
    assert sp.workload.order == "grouped" and sp.workload.seed == 3 and sp.batch_size == 5
    assert (mt.workload.turns, mt.workload.user_len, mt.workload.conversations) == (3, (6, 6), 8)
    with pytest.raises(SystemExit):
        _parse(["--gsp-question-len", "1", "2", "3"])


def test_prefix_flags_alone_pick_their_scenario_and_all_stays_the_random_presets() -> None:
    (only,) = bench_cli.scenarios_from(_parse(["--gsp-num-groups", "3", "--batch-size", "4"]))
    assert only.name == "shared-prefix" and only.batch_size == 4
    names = [s.name for s in bench_cli.scenarios_from(_parse(["--mt-turns", "2", "--input-len", "5"]))]
    assert names == ["multi-turn", "custom"]
    names = [s.name for s in bench_cli.scenarios_from(_parse(["--scenario", "all", "shared-prefix"]))]
    assert names == ["short", "long", "mixed", "high-concurrency", "shared-prefix"]
