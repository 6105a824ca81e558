#!/usr/bin/env bash
# vLLM's own serving benchmark client (`vllm bench serve`) against Baton's OpenAI gateway, then the
# same client against `vllm serve`: same generated model, dtype, threads and workload (random
# token-id prompts of fixed length, fixed output, EOS ignored, Poisson arrivals). Baton runs as
# `baton dev` starts it (its defaults, one executor) with `baton gateway` in front; the client speaks
# OpenAI's HTTP API to both (BACKEND: openai, the streamed /v1/completions, or openai-chat, the
# streamed /v1/chat/completions through each server's chat template).
# Not for CI. Needs the vLLM venv bench/vllm_compare.py makes (VLLM_PY below).
# Usage: bash bench/gateway_serve.sh [WORKDIR]   (env: PY: Baton's python, default python3; VLLM_PY,
# PROMPTS, IN, OUT_LEN, RATE, CONC, DTYPE, THREADS, BACKEND, SIDES: "baton vllm" (default) or one)
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${1:-/tmp/baton-bench}
PY=${PY:-python3}
VLLM_PY=${VLLM_PY:-$HOME/.cache/baton/vllm-venv/bin/python}
PROMPTS=${PROMPTS:-200} IN=${IN:-128} OUT_LEN=${OUT_LEN:-64} RATE=${RATE:-16} CONC=${CONC:-64}
DTYPE=${DTYPE:-float32} THREADS=${THREADS:-1} BACKEND=${BACKEND:-openai} SIDES=${SIDES:-baton vllm}
OUT=$WORKDIR/gateway-serve
MODEL=$WORKDIR/model-tiny
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || "$PY" -m baton.cli make-model --out "$MODEL" --size tiny
export OMP_NUM_THREADS=$THREADS OMP_WAIT_POLICY=PASSIVE
# vllm serve as vLLM's CPU guide sets it up: tcmalloc and Intel OpenMP preloaded where found (its workers
# then get vLLM's own Intel OpenMP spin, KMP_BLOCKTIME=5).
VLLM_PRELOAD=$("$PY" -m bench.vllm_process --ld-preload "$VLLM_PY")
ENDPOINT=/v1/completions
[ "$BACKEND" = openai-chat ] && ENDPOINT=/v1/chat/completions

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_http() {  # URL PID LOG
  for _ in $(seq 1 600); do
    curl -sf "$1" > /dev/null && return 0
    kill -0 "$2" 2>/dev/null || { tail -20 "$3" >&2; exit 1; }
    sleep 1
  done
  echo "gave up waiting for $1" >&2
  exit 1
}

client() {  # NAME PORT
  "$VLLM_PY" bench/vllm_cli.py bench serve --backend "$BACKEND" --base-url "http://127.0.0.1:$2" \
    --endpoint "$ENDPOINT" --model "$MODEL" --tokenizer "$MODEL" \
    --dataset-name random --random-input-len "$IN" --random-output-len "$OUT_LEN" --random-range-ratio 0 \
    --ignore-eos --temperature 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
    --num-prompts "$PROMPTS" --request-rate "$RATE" --burstiness 1 --max-concurrency "$CONC" --seed 0 \
    --save-result --result-dir "$OUT" --result-filename "$1.json" 2>&1 | tee "$OUT/$1.txt"
}

for side in $SIDES; do
  if [ "$side" = baton ]; then
    echo "== Baton: baton dev + baton gateway, vllm bench serve --backend $BACKEND (dtype $DTYPE)" >&2
    GRPC=$(free_port) HTTP=$(free_port)
    BATON_EXECUTOR__DTYPE=$DTYPE BATON_EXECUTOR__TORCH_THREADS=$THREADS \
      "$PY" -m baton.cli dev --model "$MODEL" --port "$GRPC" --workdir "$WORKDIR/dev" > "$OUT/baton-dev.log" 2>&1 &
    PIDS+=($!)
    "$PY" -m baton.cli gateway --host 127.0.0.1 --port "$HTTP" --target "127.0.0.1:$GRPC" \
      > "$OUT/baton-gateway.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$HTTP/v1/models" "${PIDS[-1]}" "$OUT/baton-gateway.log"
    # The gateway answers before an executor registers: wait for one completion to go through.
    for _ in $(seq 1 600); do
      curl -sf "http://127.0.0.1:$HTTP/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$MODEL\", \"prompt\": \"hi\", \"max_tokens\": 1}" > /dev/null && break
      sleep 1
    done
    client baton "$HTTP"
    cleanup
    PIDS=()
  else
    echo "== vLLM: vllm serve, vllm bench serve --backend $BACKEND" >&2
    PORT=$(free_port)
    LD_PRELOAD=$VLLM_PRELOAD VLLM_CPU_KVCACHE_SPACE=1 "$VLLM_PY" bench/vllm_cli.py serve "$MODEL" --dtype "$DTYPE" --host 127.0.0.1 \
      --port "$PORT" --max-model-len 1024 --seed 0 > "$OUT/vllm-serve.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$PORT/health" "${PIDS[-1]}" "$OUT/vllm-serve.log"
    client vllm "$PORT"
    cleanup
    PIDS=()
  fi
done
