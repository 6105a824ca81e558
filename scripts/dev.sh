#!/usr/bin/env bash
# One command without Docker: install, then run redis-server + scheduler + executor with the generated tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/baton dev "$@"
