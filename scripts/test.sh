#!/usr/bin/env bash
# One command: install everything, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/mypy .
.venv/bin/python -m common.protogen --check
.venv/bin/pytest -q "$@"
