"""baton bench's pure parts: workloads, arrivals, statistics, flag handling, the printed layouts."""

from __future__ import annotations

import argparse
import itertools
import math
import statistics

import pytest

from baton.bench import cli as bench_cli
from baton.bench.report import serve_text
from baton.bench.stats import Distribution, RequestTiming, parse_goodput, percentile, summarize
from baton.bench.workload import BOS, SCENARIOS, WorkloadSpec, arrival_offsets


def test_workload_is_seeded_and_within_ranges() -> None:
    spec = WorkloadSpec(50, (3, 9), (2, 4), seed=7)
    first, again = spec.build(), spec.build()
    assert first == again
    assert all(r.prompt_ids[0] == BOS and 3 <= len(r.prompt_ids) <= 9 for r in first)
    assert all(2 <= r.output_len <= 4 for r in first)
    assert WorkloadSpec(50, (3, 9), (2, 4), seed=8).build() != first


@pytest.mark.parametrize("bad", [dict(num_requests=0), dict(input_len=(5, 4)), dict(output_len=(0, 3))])
def test_workload_rejects_bad_sizes(bad: dict[str, object]) -> None:
    fields: dict[str, object] = {"num_requests": 1, "input_len": (1, 2), "output_len": (1, 2), **bad}
    with pytest.raises(ValueError):
        WorkloadSpec(**fields)  # type: ignore[arg-type]


def test_scenario_presets_match_their_names() -> None:
    assert set(SCENARIOS) == {"short", "long", "mixed", "high-concurrency"}
    assert SCENARIOS["short"].workload.input_len[1] < 128 and SCENARIOS["short"].workload.output_len[1] < 128
    assert SCENARIOS["long"].workload.input_len[0] > 1024
    assert SCENARIOS["high-concurrency"].workload.num_requests >= 1000
    assert SCENARIOS["high-concurrency"].batch_size >= 1000


def test_arrivals_infinite_rate_sends_at_once() -> None:
    assert arrival_offsets(4, math.inf) == [0.0] * 4


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_have_the_requested_mean_rate(burstiness: float) -> None:
    offsets = arrival_offsets(4000, 20.0, burstiness, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.1)
    # gamma(k, theta): coefficient of variation 1/sqrt(k): burstier below 1, more regular above
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(burstiness**-0.5, rel=0.15)


@pytest.mark.parametrize("rate,burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_arrivals_reject_bad_parameters(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burstiness)


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))


def _timing(
    sent: float, chunks: list[float], tokens: int, expected: int = 0, error: str = "", cached: int = 0
) -> RequestTiming:
    return RequestTiming(10, expected or tokens, sent, chunks, tokens, error, cached)


def test_summary_follows_vllm_definitions() -> None:
    timings = [
        _timing(0.0, [0.1, 0.2, 0.4], 3),  # ttft 100 ms, tpot (400-100)/2 = 150 ms, itls 100, 200
        _timing(0.5, [1.0], 1, cached=8),  # one token: no tpot, no itl
        _timing(0.0, [], 0, error="UNAVAILABLE: no executor"),
    ]
    s = summarize(timings, 2.0, {"ttft": 200, "tpot": 100})
    assert (s.completed, s.failed, s.output_tokens, s.input_tokens, s.cached_input_tokens) == (2, 1, 4, 20, 8)
    assert s.output_throughput == 2.0 and s.request_throughput == 1.0
    assert s.total_token_throughput == 12.0
    assert s.ttft.mean == pytest.approx(300.0) and s.ttft.p50 == pytest.approx(300.0)
    assert s.tpot.mean == pytest.approx(150.0)
    assert sorted([s.itl.p50, s.itl.mean]) == pytest.approx([150.0, 150.0])
    assert s.e2el.p99 == pytest.approx(500 - (500 - 400) * 0.01)
    # goodput: request 1 misses tpot (150 > 100); request 2 (ttft 500 > 200) misses ttft
    assert s.request_goodput == 0.0
    assert summarize(timings, 2.0, {"ttft": 600}).request_goodput == 1.0
    assert summarize(timings, 2.0).request_goodput is None
    flat = s.to_dict()
    assert {"mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms", "output_throughput"} <= set(flat)


def test_summary_counts_short_outputs() -> None:
    assert summarize([_timing(0.0, [0.1], 1, expected=5)], 1.0).short_requests == 1


def test_distribution_of_nothing_is_nan() -> None:
    assert math.isnan(Distribution.of([]).p99)


def test_goodput_parsing() -> None:
    assert parse_goodput(["ttft:200", "tpot:50.5", "e2el:3000"]) == {"ttft": 200.0, "tpot": 50.5, "e2el": 3000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_serve_text_has_vllm_layout() -> None:
    text = serve_text(summarize([_timing(0.0, [0.1, 0.2], 2)], 1.0, {"ttft": 500}))
    for label in ("Successful requests:", "Request goodput (req/s):", "Output token throughput (tok/s):"):
        assert label in text
    for metric in ("TTFT", "TPOT", "ITL", "E2EL"):
        for stat in ("Mean", "Median", "P90", "P99"):
            assert f"{stat} {metric} (ms):" in text


def _parse(argv: list[str]) -> argparse.Namespace:
    from baton.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


def test_bench_flags_overlay_presets() -> None:
    scenarios = bench_cli.scenarios_from(_parse(["--scenario", "short", "long", "--num-requests", "5"]))
    assert [s.name for s in scenarios] == ["short", "long"]
    assert all(s.workload.num_requests == 5 for s in scenarios)
    assert scenarios[1].workload.input_len == SCENARIOS["long"].workload.input_len


def test_bench_defaults_to_every_preset_and_sizes_make_a_custom_run() -> None:
    assert [s.name for s in bench_cli.scenarios_from(_parse([]))] == list(SCENARIOS)
    (custom,) = bench_cli.scenarios_from(
        _parse(["--input-len", "7", "--output-len-range", "2", "3", "--batch-size", "4"])
    )
    assert custom.name == "custom" and custom.batch_size == 4
    assert custom.workload.input_len == (7, 7) and custom.workload.output_len == (2, 3)


def test_bench_serve_parses_vllm_style_flags() -> None:
    args = _parse(["serve", "--request-rate", "inf", "--burstiness", "0.5", "--random-input-len", "16"])
    assert args.func is bench_cli.run_serve
    assert math.isinf(args.request_rate) and args.burstiness == 0.5 and args.input_len == 16
    with pytest.raises(SystemExit):
        _parse(["serve", "--input-len", "3", "--input-len-range", "1", "2"])
