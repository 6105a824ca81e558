"""keep_freed_memory: engine rounds on CPU stop faulting in fresh pages for their activations.

Each side runs in a fresh interpreter, because the setting is process-wide and other tests' engines
have already applied it to this one. Page faults are counted, not timed.
"""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROUNDS_SCRIPT = """
import json, random, resource, sys
from common.config import ExecutorConfig
from executor_service import model_loader
if sys.argv[2] == "untuned":
    model_loader.keep_freed_memory = lambda: False
from tests.executor_service.test_engine import admit, run_to_end
# One torch thread: a second one's malloc arena would add faults of its own to both counts.
config = ExecutorConfig(model=sys.argv[1], kv_cache_memory_mb=16, token_budget=512, torch_threads=1)
engine = model_loader.load_engine(config).engine
rng = random.Random(0)
faults = []
for r in range(3):
    prompts = [[1] + [rng.randrange(5, 8000) for _ in range(rng.randrange(100, 300))] for _ in range(12)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run_to_end(engine, {0: [admit(f"r{r}-{i}", p, 8) for i, p in enumerate(prompts)]})
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def round_faults(model_dir: Path, mode: str) -> list[int]:
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-c", ROUNDS_SCRIPT, str(model_dir), mode]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=True)
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc")
def test_warm_engine_rounds_reuse_freed_memory(tiny_model_dir: Path) -> None:
    tuned, untuned = round_faults(tiny_model_dir, "tuned"), round_faults(tiny_model_dir, "untuned")
    # Measured: untuned ~17,000 faults per warm round (each step's multi-MB activations), tuned ~1,000-3,500.
    assert tuned[-1] * 3 < untuned[-1], (tuned, untuned)
