"""Smoke test of bench/kernel_compare.py: the working tree's kernel against itself, at a toy size."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from executor_service.kernels.decode_attention import available
from tests.bench import load_script

kc = load_script("kernel_compare")


def test_compares_a_baseline_build_with_the_working_tree(capsys: pytest.CaptureFixture[str]) -> None:
    if not available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no C compiler here")
    argv = ["--baseline-dir", str(kc.KERNEL_DIR), "--shapes", "tiny", "small", "--dtypes", "bfloat16", "float32"]
    assert kc.main([*argv, "--decodes", "3", "--length", "40", "--rounds", "1", "--reps", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(row[0], row[1]) for row in rows] == [
        ("tiny", "bfloat16"),
        ("tiny", "float32"),
        ("small", "bfloat16"),
        ("small", "float32"),
    ]
    for row in rows:
        baseline_us, new_us, speedup, diff = map(float, row[2:])
        assert baseline_us > 0 and new_us > 0 and speedup > 0
        assert diff == 0.0  # the same source on both sides gives the same output


def test_reads_a_baseline_from_a_git_revision(tmp_path: Path) -> None:
    inside = subprocess.run(["git", "rev-parse", "HEAD"], cwd=kc.KERNEL_DIR, capture_output=True)
    if inside.returncode != 0:
        pytest.skip("not a git checkout")
    source = kc.baseline_sources("HEAD", None, tmp_path)
    assert source.name == "decode_attention.c" and "baton_decode_attention" in source.read_text()
    assert (tmp_path / "bf16.h").exists()
