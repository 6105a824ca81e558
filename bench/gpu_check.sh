#!/usr/bin/env bash
# The GPU check: bench/throughput.py on a ~1 B-parameter generated Llama in bfloat16 on one GPU.
# It reports Baton end to end against Baton's engine in process (a/b) and against HF generate in
# static batches (a/c), with the device figures (utilisation, memory, power) the executor reported.
#
# Needs a machine with an NVIDIA GPU and, in the Python environment it runs with:
#   pip install -c constraints.txt -e .                  # Baton, at the tested versions
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/<cuda>
#                                                        # a CUDA build of the torch constraints.txt
#                                                        # pins; <cuda> as the driver allows, e.g. cu128
# and redis-server on PATH (e.g. `apt-get install redis-server`).
#
# Run from anywhere: `bash bench/gpu_check.sh`. It takes a few minutes: phase (a) over one
# GenerateBatch stream, every request's tokens 8 at a time; then (a) again over a Generate stream per
# request, token by token. Results and logs go to $OUT (default /tmp/gpu-check): results.json,
# results-per-request.json, log.txt and the tails of the services' logs.
#
# GPU_CHECK_DRY=1 runs the same path on CPU (tiny model, float32, 16 requests) to test the script
# itself. PY overrides the interpreter (default python3), GPU_SIZE the model size, GPU_WORKDIR
# where the generated model and the services' logs go (default /tmp/baton-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
say() { echo "[gpu_check $(date +%T)] $*"; }

PY=${PY:-python3}
WORK=${GPU_WORKDIR:-/tmp/baton-gpu}
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  ARGS=(--sizes "${GPU_SIZE:-tiny}" --device cpu --dtype float32 --num-requests 16 --max-batch 16
    --rpc batch --request-stream-interval 8)
else
  # 256 requests, all admitted at once; prefill takes 2048-token steps. The KV cache is sized
  # from the workload (about 5.5 GiB in bf16). (d) generate_batch is left out: (c) is the HF
  # baseline. --short-warmup: a whole untimed pass per phase would double the run's length.
  ARGS=(--sizes "${GPU_SIZE:-1b}" --device cuda --dtype bfloat16 --num-requests 256 --max-batch 256
    --token-budget 2048 --short-warmup --rpc batch --request-stream-interval 8)
fi
export PYTHONUNBUFFERED=1

command -v redis-server >/dev/null || { say "no redis-server on PATH (install it, e.g. apt-get install redis-server)"; exit 1; }
redis-server --version

say "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv 2>/dev/null || true
$PY - "${GPU_CHECK_DRY:-0}" <<'EOF' || { say "the imports Baton needs failed: pip install -c constraints.txt -e ."; exit 1; }
import sys

import google.protobuf, grpc, redis, torch, transformers
import common.pb.executor_pb2, scheduler_service.server, executor_service.server  # noqa: F401
print(f"python ok: torch {torch.__version__} (cuda {torch.cuda.is_available()}), transformers "
      f"{transformers.__version__}, grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}, "
      f"redis-py {redis.__version__}")
if sys.argv[1] != "1" and not torch.cuda.is_available():
    sys.exit("torch sees no GPU: install a CUDA build of the pinned torch")
EOF
nproc

say "benchmark: ${ARGS[*]}"
$PY -m bench.throughput "${ARGS[@]}" --phases a b c --workdir "$WORK" --json "$OUT/results.json"
status=$?
# Then (a) again the way a serving client streams: a Generate stream per request, each token on its
# own (the last --rpc and --request-stream-interval win).
if [ "$status" = 0 ]; then
  say "phase (a) again over a Generate stream per request, token by token"
  $PY -m bench.throughput "${ARGS[@]}" --phases a --rpc generate --request-stream-interval 0 \
    --workdir "$WORK" --json "$OUT/results-per-request.json" || say "the per-request run failed (exit $?)"
fi
for f in "$WORK"/logs-*/executor.log "$WORK"/logs-*/scheduler.log; do
  [ -f "$f" ] && tail -n 40 "$f" > "$OUT/$(basename "$(dirname "$f")")-$(basename "$f")"
done
say "done, exit $status; results in $OUT"
exit $status
