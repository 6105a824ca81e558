#!/usr/bin/env bash
# The GPU check of issue #5: bench/throughput.py on a ~1 B-param random Llama in bfloat16 on one
# GPU. It reports Baton end to end against Baton's engine loop (a/b) and against HF generate
# (a/c), with the NVML figures (utilisation, memory, power) the executor reported.
#
# Run from the repo root on the GPU machine, with the gitignored folder .gpu/ beside the tree, made
# here beforehand by bench/gpu_prepare.sh (the device tool: command "bash bench/gpu_check.sh",
# carry [".gpu"]):
#   .gpu/whl/    wheels of the Python packages that machine lacks (or has too old), for cp312
#   .gpu/redis/  redis-server and the shared libraries it needs (a wrapper sets LD_LIBRARY_PATH
#                for redis-server alone, so Python and torch keep the machine's own libraries)
# Phase (a) runs as the CPU figures of P2 do (one GenerateBatch stream, every request's tokens 8 at
# a time); then, time allowing, (a) again over a Generate stream per request, token by token.
# Results and logs go to $OUT (default /tmp/gpu-check): results.json, log.txt, the services' logs.
#
# GPU_CHECK_DRY=1 runs the same path on CPU (tiny model, float32, 16 requests) to test the
# script itself; PY, PIP, GPU_WHEELS and GPU_SIZE override the interpreter, its pip, the wheel
# folder and the model size.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
say() { echo "[gpu_check $(date +%T)] $*"; }

PY=${PY:-python3}
PIP=${PIP:-$PY -m pip}
WHEELS=${GPU_WHEELS:-.gpu/whl}
SITE=${GPU_SITE:-/tmp/baton-site}
WORK=${GPU_WORKDIR:-/tmp/baton-gpu}
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  ARGS=(--sizes "${GPU_SIZE:-tiny}" --device cpu --dtype float32 --num-requests 16 --max-batch 16
    --rpc batch --request-stream-interval 8)
  BUDGET=1500
else
  # 256 requests, all admitted at once; prefill takes 2048-token steps. The KV cache is sized
  # from the workload (about 5.5 GiB in bf16). (d) generate_batch is skipped: it is not a goal.
  # --short-warmup: a whole untimed round per phase would double the run (about 100 s more on the
  # H200, mostly HF's), and a task's device time is 15 minutes in all.
  ARGS=(--sizes "${GPU_SIZE:-1b}" --device cuda --dtype bfloat16 --num-requests 256 --max-batch 256
    --token-budget 2048 --short-warmup --rpc batch --request-stream-interval 8)
  BUDGET=400  # seconds for the whole script: it must end well inside 7 minutes
fi

say "installing $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE"
$PIP install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
  || { say "wheel install failed"; exit 1; }
export PYTHONPATH="$SITE:$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$PWD/.gpu/redis:$PATH" PYTHONUNBUFFERED=1
command -v redis-server >/dev/null || { say "no redis-server on PATH"; exit 1; }
redis-server --version

say "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv 2>/dev/null || true
$PY - <<'EOF' || { say "the imports Baton needs failed"; exit 1; }
import google.protobuf, grpc, redis, torch, transformers
import common.pb.executor_pb2, scheduler_service.server, executor_service.server  # noqa: F401
print(f"python ok: torch {torch.__version__} (cuda {torch.cuda.is_available()}), transformers "
      f"{transformers.__version__}, grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}, "
      f"redis-py {redis.__version__}")
EOF
nproc

limit=$((BUDGET - 70 - SECONDS))
say "benchmark: ${ARGS[*]} (limit ${limit}s)"
timeout -k 10 "$limit" $PY bench/throughput.py "${ARGS[@]}" --phases a b c --workdir "$WORK" \
  --json "$OUT/results.json"
status=$?
# Then, if time is left, (a) again the way a serving client streams: a Generate stream per request,
# each token on its own (the last --rpc and --request-stream-interval win).
if [ "$status" = 0 ] && [ "$SECONDS" -lt $((BUDGET - 75)) ]; then
  say "phase (a) again over a Generate stream per request, token by token"
  timeout -k 10 $((BUDGET - 10 - SECONDS)) $PY bench/throughput.py "${ARGS[@]}" --phases a --rpc generate \
    --request-stream-interval 0 \
    --workdir "$WORK" --json "$OUT/results-per-request.json" || say "the per-request run failed (exit $?)"
fi
for f in "$WORK"/logs-*/executor.log "$WORK"/logs-*/scheduler.log; do
  [ -f "$f" ] && tail -n 40 "$f" > "$OUT/$(basename "$(dirname "$f")")-$(basename "$f")"
done
say "done, exit $status; results in $OUT"
exit $status
