#!/usr/bin/env bash
# `HiSparseConfig.offload` on one GPU: "always" against "under_pressure", each command timing
# HiSparse and all-GPU side by side (same prompts, replayed top-k at overlap 0.8, CUDA graphs).
#   1. batch 1, a real 128K prefill, 256 output tokens: TPOT (target <= 1.00x all-GPU);
#   2. equal concurrency, 29 x 128K with memory for both (synthetic prefill): tok/s ratio;
#   3. a 3 GiB budget, 44 x 128K, prefill-first: capacity and tok/s at peak, with demotions.
# Each writes JSON under $OUT; the last lines are the tables.
# PARTS picks the parts (default all: "batch1 equal29 cap3"; "split" adds an eager --timing run
# of the equal-concurrency cell: the step's resolve and gather time).
#   OUT=/tmp/out [PARTS="batch1 equal29"] bash benchmarks/gpu_offload_policy.sh [MODEL_DIR]
set -uo pipefail
PARTS=${PARTS:-batch1 equal29 cap3}
has() { [[ " $PARTS " == *" $1 "* ]]; }
OUT=${OUT:-/tmp/hisparse-offload}
MODEL=${1:-/tmp/v32}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ ! -f "$MODEL/config.json" ]; then
  $PY -c "from hisparse.models.tiny import make_tiny; make_tiny('deepseek_v32', '$MODEL', preset='v32-attention', num_hidden_layers=4)" >"$OUT/make_tiny.log" 2>&1
fi
B="$PY -m hisparse bench --model $MODEL --input-len 131072 --kv-placement hisparse,gpu --topk-overlap 0.8"
for off in always under_pressure; do
  if has batch1; then
    timeout 150 $B --prefill model --max-batched-tokens 16384 --gpu-memory-gib 40 --output-len 256 \
      --concurrency 1 --offload $off --json "$OUT/batch1_$off.json" >"$OUT/batch1_$off.log" 2>&1 \
      || echo "batch1 $off: rc $?"
  fi
  if has equal29; then
    timeout 150 $B --prefill synthetic --gpu-memory-gib 16 --output-len 96 --concurrency 29 \
      --schedule prefill-first --offload $off --json "$OUT/equal29_$off.json" \
      >"$OUT/equal29_$off.log" 2>&1 || echo "equal29 $off: rc $?"
  fi
done
if has split; then
  timeout 200 $B --prefill synthetic --gpu-memory-gib 16 --output-len 96 --concurrency 29 \
    --schedule prefill-first --timing --json "$OUT/equal29_split.json" >"$OUT/equal29_split.log" 2>&1 \
    || echo "split: rc $?"
fi
if has cap3; then
  timeout 150 $B --prefill synthetic --gpu-memory-gib 3 --output-len 96 --concurrency 44 \
    --schedule prefill-first --offload under_pressure --json "$OUT/cap3_under_pressure.json" \
    >"$OUT/cap3_under_pressure.log" 2>&1 || echo "cap3: rc $?"
fi
for f in "$OUT"/batch1_*.log "$OUT"/equal29_*.log "$OUT"/cap3_*.log; do
  [ -f "$f" ] || continue
  echo "== $f"; tail -n 12 "$f"
done
