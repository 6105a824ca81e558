"""The GPU check parses (running it needs a GPU, or ``GPU_CHECK_DRY=1`` and a few minutes of CPU)."""

from __future__ import annotations

import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_gpu_check_parses() -> None:
    done = subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
