#!/usr/bin/env bash
# One GPU call per part of issue #58 (measure this wave's code), each part's results beside
# the reference it checks against, logs packed into $OUT/logs.tgz, a short table last.
#   OUT=/tmp/out PARTS="tests host" BASE=_base/src bash benchmarks/gpu_wave58.sh
# PARTS (in the issue's order): tests (all of tests/gpu, xdist, a timeout per test, the
# failures rerun in one process),
# host (benchmarks/bench_host_step.py: 29 requests x 8K outputs, this tree beside $BASE),
# core (the 128K bench of docs/benchmarks.md section 1, this tree beside $BASE),
# fp8 (benchmarks/bench_fp8_gemm.py, then the v32-shapes preset in fp8 against bf16).
# BASE: another tree's src (the pre-engine-core tag: `git archive pre-engine-core src`).
# TCACHE: a tar.gz of a Triton cache to start from; the cache is packed back into
# $OUT/tcache.tgz when it fits the 16 MiB a file that the device tool returns.
set -uo pipefail
PARTS=${PARTS:-tests host core fp8}
has() { [[ " $PARTS " == *" $1 "* ]]; }
OUT=${OUT:-/tmp/hisparse-wave58}
BASE=${BASE:-}
LOGS=/tmp/wave58_logs
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
PY=${PYTHON:-python3}
TC=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -n "${TCACHE:-}" ] && [ -f "$TCACHE" ]; then mkdir -p "$TC" && tar -xzf "$TCACHE" -C "$TC"; fi
MODEL=/tmp/v32
summary=$LOGS/summary.md
: >"$summary"

if has tests; then
  t=$(date +%s)
  # SIGINT at the limit: pytest still prints the failures and the summary
  timeout -s INT "${TESTS_S:-330}" $PY -m pytest -o addopts="" -q -p no:cacheprovider -p no:benchmark \
    -n "${TEST_WORKERS:-6}" --tb=short -rf --timeout 240 --durations=15 tests/gpu \
    --junitxml="$LOGS/gpu_tests.xml" >"$LOGS/gpu_tests.log" 2>&1
  echo "tests/gpu: rc $? in $(( $(date +%s) - t )) s: $(tail -n 1 "$LOGS/gpu_tests.log")" >>"$summary"
  grep -E "^(FAILED|ERROR)" "$LOGS/gpu_tests.log" | head -20 >>"$summary"
  # workers share one card: the largest tests can fail for memory alone, so rerun the
  # failures in one process (a real defect fails there too)
  failed=$(grep -E "^FAILED" "$LOGS/gpu_tests.log" | sed -E 's/^FAILED ([^ ]+).*/\1/' | sort -u)
  if [ -n "$failed" ]; then
    timeout -s INT "${RERUN_S:-240}" $PY -m pytest -o addopts="" -q -p no:cacheprovider -p no:benchmark \
      --tb=short -rf --timeout 240 $failed >"$LOGS/gpu_tests_rerun.log" 2>&1
    echo "rerun of the failures in one process: rc $?: $(tail -n 1 "$LOGS/gpu_tests_rerun.log")" >>"$summary"
    grep -E "^(FAILED|ERROR)" "$LOGS/gpu_tests_rerun.log" | head -20 >>"$summary"
  fi
fi

if has host || has core; then
  [ -f "$MODEL/config.json" ] || $PY -c "from hisparse.models.tiny import make_tiny; make_tiny('deepseek_v32', '$MODEL', preset='v32-attention', num_hidden_layers=4)" >"$LOGS/make_tiny.log" 2>&1
fi
TREES="src${BASE:+ $BASE}"

if has host; then
  srcs=""; for s in $TREES; do srcs="$srcs --src $s"; done
  timeout "${HOST_S:-240}" $PY benchmarks/bench_host_step.py --model $MODEL --requests 29 \
    --input-len 1024 --output-len 8192 --gpu-memory-gib 16 $srcs --json "$LOGS/host_step.json" \
    >"$LOGS/host_step.log" 2>&1 || echo "host: rc $?" >>"$summary"
  grep "^|" "$LOGS/host_step.log" >>"$summary"
fi

if has core; then
  B="-m hisparse bench --model $MODEL --input-len 131072 --kv-placement hisparse,gpu --topk-overlap 0.8 --output-len 96 --schedule prefill-first --prefill synthetic"
  for cell in "equal29 under_pressure 16 29" "equal29 always 16 29" "cap3 under_pressure 3 44"; do
    set -- $cell
    for tree in $TREES; do
      tag=$1_$2_$(echo "$tree" | tr '/' '_')
      PYTHONPATH=$PWD/$tree timeout "${CELL_S:-140}" $PY $B --gpu-memory-gib $3 --concurrency $4 \
        --offload $2 --json "$LOGS/$tag.json" >"$LOGS/$tag.log" 2>&1 || echo "$tag: rc $?" >>"$summary"
      echo "== $tag" >>"$summary"; tail -n 8 "$LOGS/$tag.log" >>"$summary"
    done
  done
fi

if has fp8; then
  timeout "${GEMM_S:-200}" $PY benchmarks/bench_fp8_gemm.py --json "$LOGS/fp8_gemm.json" \
    >"$LOGS/fp8_gemm.log" 2>&1 || echo "fp8 gemm: rc $?" >>"$summary"
  grep -E "^\|" "$LOGS/fp8_gemm.log" >>"$summary"
  if [ -z "${SKIP_PRESET:-}" ]; then
    for q in fp8 bf16; do
      flag=""; [ $q = fp8 ] && flag="--fp8"
      [ -f /tmp/v32s_$q/config.json ] || timeout 240 $PY -m hisparse make-tiny --arch deepseek_v32 \
        --preset v32-shapes $flag /tmp/v32s_$q >"$LOGS/make_$q.log" 2>&1 || echo "make $q: rc $?" >>"$summary"
    done
    for q in fp8 bf16; do
      timeout "${PRESET_S:-120}" $PY -m hisparse bench --model /tmp/v32s_$q --prefill model \
        --input-len 16384 --output-len 64 --concurrency 1 --kv-placement gpu --topk-overlap off \
        --gpu-memory-gib 8 --max-batched-tokens 16384 --json "$LOGS/preset_$q.json" \
        >"$LOGS/preset_$q.log" 2>&1 || echo "preset $q: rc $?" >>"$summary"
      echo "== v32-shapes $q" >>"$summary"; tail -n 8 "$LOGS/preset_$q.log" >>"$summary"
    done
  fi
fi

tar -czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null
if [ -d "$TC" ]; then
  tar -czf "$OUT/tcache.tgz" -C "$TC" . 2>/dev/null
  [ "$(stat -c %s "$OUT/tcache.tgz")" -lt 16000000 ] || rm -f "$OUT/tcache.tgz"
fi
cat "$summary"
