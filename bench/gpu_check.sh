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
# Run from anywhere: `bash bench/gpu_check.sh`. It takes a few minutes, in this order, each step
# after the first only while GPU_CHECK_BUDGET_S (default 420) seconds have not passed:
#   1. phases (a), (b), (c) with CUDA graphs on (executor.cuda_graphs, the default): (a) over one
#      GenerateBatch stream, every request's tokens 8 at a time -> results.json;
#   2. phases (a) and (b) with 256-token KV blocks, where decodes read the cache in place through
#      torch's FlashAttention instead of gathering it (executor_service/paged_decode.py; the
#      executor's log says which it used) -> results-paged.json;
#   3. where pytest is installed, the tests that need a GPU: graph replays against eager steps and
#      model.generate, the in-place kernel against the gathered reads (tests/executor_service/
#      test_decode_graphs.py, test_paged_decode.py) -> tests-gpu.txt;
#   4. the engine's host time per decode step at 64 and 256 running requests, graphs on
#      (bench/engine_profile.py) -> engine-profile-graphs-on.txt;
#   5. phases (a) and (b) again with CUDA graphs off (the same padded decode steps, eager)
#      -> results-graphs-off.json;
#   6. (a) again over a Generate stream per request, token by token -> results-per-request.json;
#   7. phase (b) with overlapped steps off (executor.async_scheduling, on by default on CUDA)
#      -> results-overlap-off.json;
#   8. the engine profile with graphs off, then with 256-token blocks -> engine-profile-graphs-off.txt,
#      engine-profile-paged.txt.
# Results and logs go to $OUT (default /tmp/gpu-check), with log.txt and the tails of the
# services' logs. Each results file holds the device load (NVML: utilisation, memory, power)
# sampled during (a) and (b).
#
# GPU_CHECK_DRY=1 runs the same path on CPU (tiny model, float32, 16 requests; graphs are a CUDA
# setting, so "on" and "off" run alike there) to test the script itself. PY overrides the
# interpreter (default python3), GPU_SIZE the model size, GPU_WORKDIR where the generated model
# and the services' logs go (default /tmp/baton-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
say() { echo "[gpu_check $(date +%T)] $*"; }

PY=${PY:-python3}
WORK=${GPU_WORKDIR:-/tmp/baton-gpu}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  # The engine profile reads the model phase (a) generated (bench/throughput.py names its directory).
  DEVICE=cpu DTYPE=float32 MODEL_DIR="$WORK/model-${GPU_SIZE:-tiny}" RUNNING=(4 16) KV_MB=256
  ARGS=(--sizes "${GPU_SIZE:-tiny}" --device cpu --dtype float32 --num-requests 16 --max-batch 16
    --rpc batch --request-stream-interval 8)
else
  DEVICE=cuda DTYPE=bfloat16 MODEL_DIR="$WORK/model-${GPU_SIZE:-1b}-bfloat16" RUNNING=(64 256) KV_MB=4096
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

say "benchmark, CUDA graphs on: ${ARGS[*]}"
$PY -m bench.throughput "${ARGS[@]}" --phases a b c --cuda-graphs on --workdir "$WORK" --json "$OUT/results.json"
status=$?
# Each later step runs only while the budget lasts (a machine lent for a few minutes cuts a longer run off).
more() {
  if ((SECONDS < BUDGET)); then say "$1 ($SECONDS s of $BUDGET used)"; return 0; fi
  say "skipped, the budget is spent: $1"
  return 1
}
profile() {  # name, then extra flags
  local name=$1
  shift
  $PY -m bench.engine_profile --model "$MODEL_DIR" --device "$DEVICE" --dtype "$DTYPE" \
    --running "${RUNNING[@]}" --steps 40 --kv-cache-mb "$KV_MB" "$@" 2>&1 \
    | grep -v '^Loading weights' | tee "$OUT/engine-profile-$name.txt" \
    || say "the engine profile ($name) failed"
}
if [ "$status" = 0 ]; then
  if more "phases (a) and (b) with 256-token KV blocks (decodes read in place where the kernel serves)"; then
    $PY -m bench.throughput "${ARGS[@]}" --phases a b --block-size 256 --workdir "$WORK" \
      --json "$OUT/results-paged.json" || say "the 256-token-block run failed (exit $?)"
  fi
  if [ "${GPU_CHECK_DRY:-0}" != 1 ] && $PY -c "import pytest" 2>/dev/null && more "the tests that need a GPU"; then
    $PY -m pytest -q tests/executor_service/test_decode_graphs.py tests/executor_service/test_paged_decode.py 2>&1 \
      | tee "$OUT/tests-gpu.txt" || say "GPU tests failed"
  fi
  more "engine host time per decode step, graphs on (running ${RUNNING[*]})" && profile graphs-on --cuda-graphs on
  if more "phases (a) and (b) again with CUDA graphs off"; then
    $PY -m bench.throughput "${ARGS[@]}" --phases a b --cuda-graphs off --workdir "$WORK" \
      --json "$OUT/results-graphs-off.json" || say "the graphs-off run failed (exit $?)"
  fi
  # (a) again the way a serving client streams: a Generate stream per request, each token on its own
  # (the last --rpc and --request-stream-interval win).
  if more "phase (a) again over a Generate stream per request, token by token"; then
    $PY -m bench.throughput "${ARGS[@]}" --phases a --rpc generate --request-stream-interval 0 \
      --workdir "$WORK" --json "$OUT/results-per-request.json" || say "the per-request run failed (exit $?)"
  fi
  if more "phase (b) again with overlapped steps off (each step's tokens read before the next launches)"; then
    $PY -m bench.throughput "${ARGS[@]}" --phases b --async-scheduling off --workdir "$WORK" \
      --json "$OUT/results-overlap-off.json" || say "the overlap-off run failed (exit $?)"
  fi
  more "engine host time per decode step, graphs off" && profile graphs-off --cuda-graphs off
  more "engine host time per decode step, 256-token blocks" && profile paged --cuda-graphs on --block-size 256
fi
for f in "$WORK"/logs-*/executor.log "$WORK"/logs-*/scheduler.log; do
  [ -f "$f" ] && tail -n 40 "$f" > "$OUT/$(basename "$(dirname "$f")")-$(basename "$f")"
done
say "done, exit $status; results in $OUT"
exit $status
