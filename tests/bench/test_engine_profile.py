"""Smoke test of bench/engine_profile.py: a decode-step profile on the tiny model, its parts adding up."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.engine_profile import main, profile_decode
from common.config import ExecutorConfig
from executor_service.model_loader import load_engine


def test_profile_splits_a_decode_step_and_leaves_the_engine_empty(tiny_model_dir: Path) -> None:
    engine = load_engine(ExecutorConfig(model=str(tiny_model_dir), kv_cache_memory_mb=64)).engine
    row = profile_decode(engine, running=4, steps=3)
    assert row.running == 4
    assert min(row.forward_ms, row.inputs_ms, row.after_ms) >= 0
    assert row.forward_ms <= row.step_ms
    assert not engine.running  # its requests were aborted
    assert engine.allocator.num_used == 0
    again = profile_decode(engine, running=2, steps=2)  # the engine's own methods are back in place
    assert again.running == 2


def test_cli_prints_a_row_per_count(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_model_dir), "--running", "2", "4", "--steps", "2", "--kv-cache-mb", "64"]) == 0
    out = capsys.readouterr().out
    assert "host/req us" in out and "per running request" in out
