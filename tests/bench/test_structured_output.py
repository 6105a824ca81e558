"""Smoke test of the structured-output benchmark: a tiny run prints a well-formed ratio."""

from __future__ import annotations

import re
from pathlib import Path

from tests.bench.test_scheduling_benches import run_bench


def test_structured_output_prints_a_throughput_ratio(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "model-tiny").symlink_to(tiny_model_dir)
    out = run_bench("structured_output", "--requests", "3", "--items", "1", "--pairs", "1", "--workdir", str(tmp_path))
    assert len(re.findall(r"run 1 +(un)?constrained: +\d+\.\d+ s", out)) == 2, out
    match = re.search(r"throughput ratio \(constrained / unconstrained, medians\): (\d+\.\d+)", out)
    assert match and float(match.group(1)) > 0, out
