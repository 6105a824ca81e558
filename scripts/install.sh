#!/usr/bin/env bash
# Install Baton and its test tools into .venv (torch first, the version pinned here: the CPU wheel
# where the package index serves one, as these machines' does).
set -euo pipefail
cd "$(dirname "$0")/.."
need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v docker-compose >/dev/null || need_apt+=(docker-compose)
if ((${#need_apt[@]})) && command -v apt-get >/dev/null; then
  # redis-server is required by the tests; docker-compose only adds one optional check.
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}") >/dev/null \
    || echo "install.sh: could not apt-get install ${need_apt[*]}" >&2
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# constraints.txt pins what CI is tested with (see its header for how to upgrade).
.venv/bin/pip install -q -c constraints.txt torch==2.13.0
.venv/bin/pip install -q -c constraints.txt -e '.[dev]'
