"""Smoke test of bench/linear_compare.py: every layer of the tiny model, at toy repetitions."""

from __future__ import annotations

import pytest

from executor_service.kernels.small_gemm import torch_brgemm
from tests.bench import load_script

lc = load_script("linear_compare")


def test_prints_each_layer_and_row_count_with_a_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    if torch_brgemm() is None:
        pytest.skip("no bf16 micro-kernel on this CPU")
    assert lc.main(["--size", "tiny", "--rows", "1", "17", "--rounds", "1", "--reps", "2", "--cold"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(row[0], int(row[2])) for row in rows] == [
        (layer, count) for layer in ("qkv", "o", "gate_up", "down", "lm_head") for count in (1, 17)
    ]
    for row in rows:
        onednn_us, kernel_us, ratio, diff = map(float, row[3:7])
        assert onednn_us > 0 and kernel_us > 0 and ratio > 0
        assert diff < 0.1  # the same product, rounded once to bf16 on both paths
    engine = {row[0]: row[7] for row in rows}
    assert engine == {"qkv": "kernel", "o": "kernel", "gate_up": "oneDNN", "down": "kernel", "lm_head": "oneDNN"}


def test_refuses_prefill_row_counts() -> None:
    if torch_brgemm() is None:
        pytest.skip("no bf16 micro-kernel on this CPU")
    with pytest.raises(SystemExit):
        lc.main(["--rows", "65"])
