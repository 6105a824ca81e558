"""Smoke tests of the scheduling benchmarks: tiny sizes, checking they run and print well-formed figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, *args: str, timeout: float = 240) -> str:
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_queue_scale_prints_a_p99_ratio() -> None:
    out = run_bench("queue_scale", "--sizes", "50", "200", "--rounds", "20", "--tenants", "3")
    match = re.search(r"admission p99 ratio 200/50: (\d+\.\d+); enqueue p99 ratio: (\d+\.\d+)", out)
    assert match, out
    assert float(match.group(1)) > 0 and float(match.group(2)) > 0


def test_priority_load_compares_adaptive_with_fifo(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "model-tiny").symlink_to(tiny_model_dir)
    table = tmp_path / "table.md"
    args = ["--seconds", "3", "--pairs", "1", "--capacity-requests", "12", "--unloaded-requests", "2"]
    args += ["--workdir", str(tmp_path)]
    out = run_bench("priority_load", *args, "--markdown", str(table))
    rows = [line for line in table.read_text().splitlines() if line.startswith(("| Baton", "| FIFO"))]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert re.fullmatch(r"\d+%", cells[4]) and float(cells[5]) >= 0, row
