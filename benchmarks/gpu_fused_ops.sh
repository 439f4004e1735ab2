#!/usr/bin/env bash
# The fused layer ops on one GPU (issue #21): their tests against the torch references, then
# the 128K decode step profiled with the torch compositions (HISPARSE_FUSED=reference) and with
# the fused kernels, both placements, the model's own indexer (no replayed top-k).
# Prints the pytest summary and each profile's table last; details under $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_fused_ops.sh
set -uo pipefail
OUT=${OUT:-/tmp/hisparse-fused}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
timeout 240 $PY -m pytest -o addopts="" -q --tb=short -p no:cacheprovider tests/gpu/test_fused_gpu.py \
  >"$OUT/test_fused_gpu.txt" 2>&1 || echo "test_fused_gpu: rc $?"
P="--context 131072 --batches 1,29 --paths graphs --output 12 --skip 4 --active 3 --gpu-memory-gib 14"
for f in reference triton; do
  HISPARSE_FUSED=$f timeout 170 $PY benchmarks/profile_decode.py $P --overlap 0 --top-kernels 70 \
    --out "$OUT/profile_$f" >"$OUT/profile_$f.txt" 2>&1 || echo "profile $f: rc $?"
done
tail -n 3 "$OUT/test_fused_gpu.txt"
for f in reference triton; do
  echo "== HISPARSE_FUSED=$f"; grep "^| \|same tokens" "$OUT/profile_$f.txt"
done
