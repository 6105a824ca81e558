"""Smoke tests of the benchmark scripts under bench/ (loaded from their files: bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_script(name: str) -> ModuleType:
    """Import ``bench/NAME.py`` as module ``NAME`` (once), with bench/ on sys.path for its own imports."""
    if name in sys.modules:
        return sys.modules[name]
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
