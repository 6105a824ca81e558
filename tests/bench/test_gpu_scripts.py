"""The GPU check's two scripts parse (running them needs PyPI, for the one, and a GPU, for the other)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", ["gpu_prepare.sh", "gpu_check.sh"])
def test_script_parses(script: str) -> None:
    done = subprocess.run(["bash", "-n", str(BENCH / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
