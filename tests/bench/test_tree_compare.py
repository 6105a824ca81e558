"""Smoke test of bench/tree_compare.py: the working tree against itself, at a toy size."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.bench import load_script

tc = load_script("tree_compare")


def test_compares_two_trees_in_two_halves(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "model-tiny").symlink_to(tiny_model_dir)
    argv = ["--baseline-dir", str(tc.REPO), "--dtype", "float32", "--executors", "1", "--num-requests", "3"]
    assert tc.main([*argv, "--rounds", "2", "--request-stream-interval", "1", "--workdir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rounds = [line for line in lines if line.startswith("half ")]
    # One round per side per half; the second half starts (and so runs first) the other side.
    assert [line.split(":")[0] for line in rounds] == [
        "half 1, working tree",
        "half 1, baseline",
        "half 2, baseline",
        "half 2, working tree",
    ]
    assert any(line.startswith("working tree: median round") for line in lines)
    assert any(line.startswith("baseline: median round") for line in lines)
    ratio = float(lines[-1].rsplit(":", 1)[1])
    assert ratio > 0


def test_exports_a_git_revision(tmp_path: Path) -> None:
    inside = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tc.REPO, capture_output=True)
    if inside.returncode != 0:
        pytest.skip("not a git checkout")
    tree = tc.export_revision("HEAD", tmp_path)
    assert (tree / "executor_service" / "engine.py").exists() and (tree / "bench" / "tree_compare.py").exists()


def test_needs_a_round_per_half() -> None:
    with pytest.raises(SystemExit):
        tc.main(["--baseline-dir", ".", "--rounds", "1"])
