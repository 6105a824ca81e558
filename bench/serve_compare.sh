#!/usr/bin/env bash
# `baton bench serve` against Baton, then `vllm bench serve` against `vllm serve`: same generated model,
# dtype, thread settings and workload (random token-id prompts of fixed length, fixed output, EOS ignored,
# Poisson arrivals). One after the other on this machine; both JSON results land in $OUT.
# Not for CI. Needs the vLLM venv bench/vllm_compare.py makes (VLLM_PY below).
# Usage: bash bench/serve_compare.sh [WORKDIR]   (env: PY: Baton's python, default python3; VLLM_PY, PROMPTS,
# IN, OUT_LEN, RATE, CONC, DTYPE, THREADS,
# EXECUTORS: Baton's executor processes, default 1; BATON_THREADS: each executor's torch threads, default
# THREADS, 0 for the executor's own choice per step)
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${1:-/tmp/baton-bench}
PY=${PY:-python3}
VLLM_PY=${VLLM_PY:-$HOME/.cache/baton/vllm-venv/bin/python}
PROMPTS=${PROMPTS:-200} IN=${IN:-128} OUT_LEN=${OUT_LEN:-64} RATE=${RATE:-16} CONC=${CONC:-64}
DTYPE=${DTYPE:-float32} THREADS=${THREADS:-1} EXECUTORS=${EXECUTORS:-1}
BATON_THREADS=${BATON_THREADS:-$THREADS}
OUT=$WORKDIR/serve-compare
MODEL=$WORKDIR/model-tiny
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || "$PY" -m baton.cli make-model --out "$MODEL" --size tiny
export OMP_NUM_THREADS=$THREADS OMP_WAIT_POLICY=PASSIVE
# vllm serve as vLLM's CPU guide sets it up: tcmalloc and Intel OpenMP preloaded where found (its workers
# then get vLLM's own Intel OpenMP spin, KMP_BLOCKTIME=5).
VLLM_PRELOAD=$("$PY" -m bench.vllm_process --ld-preload "$VLLM_PY")
COMMON=(--num-prompts "$PROMPTS" --request-rate "$RATE" --burstiness 1 --max-concurrency "$CONC" --seed 0
        --save-result --result-dir "$OUT")

echo "== Baton: baton bench serve --local (dtype $DTYPE, $BATON_THREADS torch threads, $EXECUTORS executors)" >&2
BATON_EXECUTOR__TORCH_THREADS=$BATON_THREADS "$PY" -m baton.cli bench serve --local --workdir "$WORKDIR" --model "$MODEL" \
  --dtype "$DTYPE" --executors "$EXECUTORS" --input-len "$IN" --output-len "$OUT_LEN" --no-progress "${COMMON[@]}" \
  --result-filename baton.json | tee "$OUT/baton.txt"

echo "== vLLM: vllm serve + vllm bench serve" >&2
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
LD_PRELOAD=$VLLM_PRELOAD VLLM_CPU_KVCACHE_SPACE=1 "$VLLM_PY" bench/vllm_cli.py serve "$MODEL" --dtype "$DTYPE" --host 127.0.0.1 --port "$PORT" \
  --max-num-seqs "$CONC" --max-model-len 1024 --seed 0 > "$OUT/vllm-serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/vllm-serve.log" >&2; exit 1; }
  sleep 1
done
"$VLLM_PY" bench/vllm_cli.py bench serve --backend vllm --base-url "http://127.0.0.1:$PORT" --model "$MODEL" \
  --dataset-name random --random-input-len "$IN" --random-output-len "$OUT_LEN" --random-range-ratio 0 --ignore-eos --temperature 0 \
  --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 "${COMMON[@]}" \
  --result-filename vllm.json 2>&1 | tee "$OUT/vllm.txt"
