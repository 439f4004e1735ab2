#!/usr/bin/env bash
# The front-door benchmarks in one GPU run: real chunked prefill (TTFT and MFU at 16K / 64K /
# 128K, both placements), decodes alongside a long prefill, and `hisparse serve` driven over
# HTTP. Each writes JSON under $OUT; the last lines are the tables.
#   OUT=/tmp/out bash benchmarks/gpu_front_door.sh [MODEL_DIR]
# MODEL_DIR defaults to a 4-layer v32-attention tiny checkpoint made here. `hisparse serve`
# needs fastapi/uvicorn/pydantic importable (the `serve` extra).
set -uo pipefail
OUT=${OUT:-/tmp/hisparse-front-door}
MODEL=${1:-/tmp/v32}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ ! -f "$MODEL/config.json" ]; then
  $PY -c "from hisparse.models.tiny import make_tiny; make_tiny('deepseek_v32', '$MODEL', preset='v32-attention', num_hidden_layers=4)" >"$OUT/make_tiny.log" 2>&1
fi
for n in 16384 65536 131072; do
  timeout 200 $PY -m hisparse bench --model "$MODEL" --prefill model --input-len $n --output-len 64 \
    --topk-overlap 0.8 --gpu-memory-gib 40 --max-batched-tokens 16384 --concurrency 1 \
    --json "$OUT/prefill_$n.json" >"$OUT/prefill_$n.log" 2>&1 || echo "prefill $n: rc $?"
done
timeout 150 $PY benchmarks/bench_mixed_prefill.py --model "$MODEL" --long-len 65536 --long-count 1 \
  --short-count 8 --short-len 512 --output-len 64 --max-batched-tokens 8192 --gpu-memory-gib 8 \
  --host-pool-gib 8 --out "$OUT" >"$OUT/mixed.log" 2>&1 || echo "mixed: rc $?"
timeout 200 $PY benchmarks/bench_serve.py --model "$MODEL" --input-len 16384 --output-len 64 \
  --num-prompts 16 --request-rate 1 --startup-timeout 120 --timeout 150 --out "$OUT" \
  -- --gpu-memory-gib 8 --max-num-seqs 16 --host-pool-gib 8 --max-model-len 16448 \
  >"$OUT/serve.log" 2>&1 || echo "serve: rc $?"
for f in "$OUT"/prefill_*.log; do echo "== $f"; tail -n 14 "$f"; done
echo "== mixed"; tail -n 12 "$OUT/mixed.log"
echo "== serve"; tail -n 14 "$OUT/serve.log"
