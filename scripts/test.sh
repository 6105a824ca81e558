#!/usr/bin/env bash
# One command: install everything, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/mypy .
.venv/bin/python -m common.protogen --check
# Two workers: most tests wait on servers, subprocesses and Redis as much as they compute, so
# two at once finish the suite in about two thirds of the time on two cores. `-n 0` runs serially.
.venv/bin/pytest -q -n 2 "$@"
