#!/usr/bin/env bash
# The fused ops on one GPU (issue #21), in parts (PARTS, default "tests profile"):
#   tests    the fused kernels' GPU tests against the torch references, then the engine's
#            GPU tests (lossless HiSparse vs all-GPU, CUDA graphs) on the fused path;
#   profile  the 128K decode step profiled with the torch compositions
#            (HISPARSE_FUSED=reference) and with the fused kernels, both placements, the
#            model's own indexer (no replayed top-k), one checkpoint for both;
#   smol     SmolLM2-135M (a GGUF at $SMOL_GGUF) at batch 64 against transformers, torch
#            compositions vs fused kernels (benchmarks/bench_smollm2.py).
# Prints each part's summary last; details under $OUT.
#   OUT=/tmp/out PARTS="tests profile" bash benchmarks/gpu_fused_ops.sh
set -uo pipefail
OUT=${OUT:-/tmp/hisparse-fused}
PARTS=${PARTS:-tests profile}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
has() { [[ " $PARTS " == *" $1 "* ]]; }

if has tests; then
  timeout 150 $PY -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
    tests/gpu/test_fused_gpu.py >"$OUT/test_fused_gpu.txt" 2>&1 || echo "test_fused_gpu: rc $?"
  timeout 240 $PY -m pytest -o addopts="" -q -x --tb=short -p no:cacheprovider \
    tests/gpu/test_engine_gpu.py >"$OUT/test_engine_gpu.txt" 2>&1 || echo "test_engine_gpu: rc $?"
fi
if has profile; then
  CKPT=${CKPT:-/tmp/v32p}
  [ -f "$CKPT/config.json" ] || $PY -c "from hisparse.models.tiny import make_tiny; \
make_tiny('deepseek_v32', '$CKPT', preset='v32-attention', num_hidden_layers=4)" \
    >"$OUT/make_tiny.txt" 2>&1
  P="--model $CKPT --layers 4 --context 131072 --batches 1,29 --paths graphs --output 12"
  P="$P --skip 4 --active 3 --gpu-memory-gib 14 --overlap 0 --top-kernels 70"
  for f in reference triton; do
    HISPARSE_FUSED=$f timeout 170 $PY benchmarks/profile_decode.py $P \
      --out "$OUT/profile_$f" >"$OUT/profile_$f.txt" 2>&1 || echo "profile $f: rc $?"
  done
fi
if has smol; then
  GGUF=${SMOL_GGUF:-/tmp/smol.gguf}
  if [ -f "$GGUF" ]; then
    for f in reference triton; do
      HISPARSE_FUSED=$f timeout 150 $PY benchmarks/bench_smollm2.py --device cuda --batch 64 \
        --max-tokens 64 --top-k 256 --model "$GGUF" --out "$OUT/smol_$f" \
        >"$OUT/smol_$f.txt" 2>&1 || echo "smol $f: rc $?"
    done
  else
    echo "smol: no GGUF at $GGUF"
  fi
fi

if has tests; then
  tail -n 3 "$OUT/test_fused_gpu.txt" "$OUT/test_engine_gpu.txt"
fi
if has profile; then
  for f in reference triton; do
    echo "== profile HISPARSE_FUSED=$f"; grep "^| \|same tokens" "$OUT/profile_$f.txt"
  done
fi
if has smol; then
  for f in reference triton; do
    [ -f "$OUT/smol_$f.txt" ] && { echo "== smol HISPARSE_FUSED=$f"; grep "^| \|tok/s" "$OUT/smol_$f.txt" | tail -6; }
  done
fi
exit 0
