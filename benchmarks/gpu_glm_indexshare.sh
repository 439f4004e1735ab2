#!/usr/bin/env bash
# Capacity on a GLM-5 IndexShare shape (24 layers, index_topk_freq 4, index_skip_topk_offset 3,
# GLM-5's MLA and indexer rows) at a 6 GiB KV budget and 128K prompts: the engine's peak held
# requests against `hisparse plan`, both placements, then `hisparse simulate --compare` on the
# same JSON (predicted running requests and swapped bytes against the measured ones).
# The checkpoint keeps GLM-5's KV dimensions (kv_lora_rank 512, rope 64, indexer 128) and
# shrinks the hidden size and heads so its 24 layers load in seconds: the KV layout, and so
# the plan, is the same as with the real hidden size (`hisparse plan` on both config.json).
#   OUT=/tmp/out bash benchmarks/gpu_glm_indexshare.sh [MODEL_DIR]
set -uo pipefail
OUT=${OUT:-/tmp/hisparse-glm}
MODEL=${1:-/tmp/glm24}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ ! -f "$MODEL/config.json" ]; then
  $PY -c "from hisparse.models.tiny import make_tiny; make_tiny('glm_moe_dsa', '$MODEL', preset='v32-attention', num_hidden_layers=24, index_topk_freq=4, index_skip_topk_offset=3, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16)" >"$OUT/make_tiny.log" 2>&1
fi
$PY -m hisparse plan --model "$MODEL" --gpu-memory-gib 6 --host-pool-gib 64 --max-model-len 131168 \
  --max-batched-tokens 16384 >"$OUT/plan.txt" 2>&1
timeout 420 $PY -m hisparse bench --model "$MODEL" --input-len 131072 --output-len 96 \
  --kv-placement hisparse,gpu --topk-overlap 0.8 --prefill synthetic --gpu-memory-gib 6 \
  --host-pool-gib 64 --concurrency 34 --schedule prefill-first --json "$OUT/cap6.json" \
  >"$OUT/cap6.log" 2>&1 || echo "bench: rc $?"
timeout 120 $PY -m hisparse simulate --compare "$OUT/cap6.json" --model "$MODEL" \
  --host-pool-gib 64 --plot "$OUT/simulate_cap6.png" >"$OUT/simulate.log" 2>&1 || echo "simulate: rc $?"
tail -n 4 "$OUT/plan.txt"
echo "== bench"; tail -n 14 "$OUT/cap6.log"
echo "== simulate --compare"; tail -n 14 "$OUT/simulate.log"
