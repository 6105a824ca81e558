"""bench/scheduler_scale.py: a tiny run (2 simulated executors, a short window) gives well-formed numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench import scheduler_scale as scale


def test_histogram_p99_interpolates_inside_the_bucket() -> None:
    before = {0.01: 10.0, 0.1: 10.0, float("inf"): 10.0}
    after = {0.01: 60.0, 0.1: 110.0, float("inf"): 110.0}  # 50 below 10 ms, 50 in 10-100 ms
    assert scale.histogram_p99(before, after) == (0.01 + 0.09 * (99 - 50) / 50)
    assert math.isnan(scale.histogram_p99(after, after))


def test_tiny_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "model-tiny").symlink_to(tiny_model_dir)  # the scheduler's tokenizer
    out = tmp_path / "scale.json"
    argv = ["--counts", "2", "--max-batch-size", "4", "--output-len", "8", "--warmup", "1", "--window", "2"]
    assert scale.main([*argv, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["executors"] == 2 and row["target_steps_s"] == 80.0
    assert row["executor_steps_s"] > 0 and row["scheduler_steps_s"] > 0 and row["requests_done"] >= 0
    assert 0 < row["ratio"] <= 1.2 and 0 < row["busy"] <= 1.05 and 0 < row["batch_fill"] <= 1.0
    assert row["cpu_ms_per_plan"] > 0 and row["scheduler_cores"] > 0
    # a loaded machine may see no plan in the short window; when there are plans, the figures are ordered
    assert math.isnan(row["plan_p50_ms"]) or row["plan_p99_ms"] >= row["plan_p50_ms"] > 0
