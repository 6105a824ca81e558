"""Smoke test of bench/shared_prefix_attention.py: both sides run, agree bit for bit, and a ratio prints."""

from __future__ import annotations

import pytest
import torch

from bench.shared_prefix_attention import main
from executor_service.kernels.decode_attention import available


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prints_the_ratio_of_alone_over_together(dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    if not available(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip("no C compiler here")
    shape = ["--groups", "2", "--per-group", "3", "--prefix-blocks", "4"]
    assert main(["--dtype", dtype, *shape, "--calls", "2", "--pairs", "2"]) == 0
    out = capsys.readouterr().out
    assert "6 decodes" in out and "median alone/together" in out
