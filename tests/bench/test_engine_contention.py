"""Smoke test of bench/engine_contention.py: both sides run, at a toy size, and the report adds up."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import psutil
import pytest

from tests.bench import load_script

ec = load_script("engine_contention")


def test_runs_alone_and_loaded_and_reports_the_ratios(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "model-tiny").symlink_to(tiny_model_dir)
    argv = ["--dtype", "float32", "--num-requests", "2", "--rounds", "1", "--duty", "0.5"]
    assert ec.main([*argv, "--workdir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["alone", "loaded"]
    assert lines[-1].startswith("loaded / alone: round seconds ")
    assert float(lines[-1].rsplit(" ", 1)[1]) > 0


def test_the_load_stops_when_told() -> None:
    stop = mp.get_context("spawn").Event()
    load = mp.get_context("spawn").Process(target=ec.bursty_load, args=(0.5, stop), daemon=True)
    load.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and psutil.Process(load.pid).cpu_times().user < 0.05:
        time.sleep(0.01)  # until it is busy in its loop (a spawned interpreter starts slowly)
    stop.set()
    load.join(timeout=10)
    assert load.exitcode == 0


def test_rejects_a_duty_outside_zero_to_one() -> None:
    with pytest.raises(SystemExit):
        ec.main(["--duty", "1.5"])
