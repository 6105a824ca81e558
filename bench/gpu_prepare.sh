#!/usr/bin/env bash
# Prepares .gpu/ for bench/gpu_check.sh, here, on a machine that reaches PyPI: the GPU machine reaches
# nothing, and a task's device time (15 minutes) is too short to spend on a failed install there.
#   .gpu/whl/    the Python packages Baton's services import that the H200 image lacks, or holds at a
#                version the generated protobuf and gRPC code refuses, pinned to the versions this venv
#                runs, as wheels for the image's Python (3.12)
#   .gpu/redis/  this machine's redis-server with the shared libraries it links beyond glibc, behind a
#                wrapper that sets LD_LIBRARY_PATH for redis-server alone
# Then, in a task lent a device: the device tool's run with command "bash bench/gpu_check.sh" and
# carry [".gpu"]. The image already holds torch, transformers, tokenizers, safetensors, numpy, psutil,
# PyYAML, prometheus-client, rich, nvidia-ml-py and typing-extensions (the device tool's KINDS.md).
#
# GPU_PYTHON_VERSION (default 3.12) chooses the wheels' Python; PY (default .venv/bin/python) is the
# interpreter whose installed versions are pinned and whose pip downloads them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${GPU_PYTHON_VERSION:-3.12}
GPU=.gpu
CARRY=(grpcio grpcio-health-checking grpcio-reflection grpcio-status protobuf googleapis-common-protos
  redis hiredis opentelemetry-api opentelemetry-sdk opentelemetry-instrumentation
  opentelemetry-instrumentation-grpc opentelemetry-semantic-conventions wrapt)

pins=$("$PY" - "${CARRY[@]}" <<'EOF'
import importlib.metadata as md
import sys

print(" ".join(f"{name}=={md.version(name)}" for name in sys.argv[1:]))
EOF
)
rm -rf "$GPU/whl" "$GPU/redis"
mkdir -p "$GPU/whl" "$GPU/redis/lib"
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
# shellcheck disable=SC2086  # $pins is a list of requirement specifiers
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" -d "$GPU/whl" $pins

server=$(command -v redis-server) || { echo "gpu_prepare: no redis-server on PATH" >&2; exit 1; }
cp "$server" "$GPU/redis/lib/redis-server"
# Its libraries beyond glibc's own (the image's glibc is newer than Debian 12's, so it runs there).
ldd "$server" | awk '/=> \// {print $3}' | grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' \
  | while read -r lib; do cp -L "$lib" "$GPU/redis/lib/"; done
cat > "$GPU/redis/redis-server" <<'EOF'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/lib/redis-server" "$@"
EOF
chmod +x "$GPU/redis/redis-server"
"$GPU/redis/redis-server" --version
echo "gpu_prepare: $(ls "$GPU/whl" | wc -l) wheels for Python $PYVER and redis-server in $GPU ($(du -sh "$GPU" | cut -f1))"
