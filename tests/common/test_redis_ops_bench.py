"""Smoke test of ``bench/redis_ops.py``: it measures, batching cuts Redis commands per token, and the
tokens stay the same."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench" / "redis_ops.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("redis_ops_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


async def test_batching_cuts_commands_per_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    bench = _bench()
    workload = bench.make_workload(count=4, max_tokens=24, seed=1)
    plain, batched = await bench.measure(tiny_model_dir, workload, [(1, 0), (8, 0)], tmp_path)
    assert plain.tokens == batched.tokens == 4 * 24
    assert plain.outputs == batched.outputs
    assert batched.stream_entries < plain.stream_entries
    assert batched.commands_per_token < plain.commands_per_token
    # Round trips are not compared: how many writes a busy replica merges into one depends on load.
    assert batched.round_trips_per_token > 0
    assert "the same tokens: yes" in bench.report([plain, batched])
