#!/usr/bin/env bash
# The fused ops on one GPU (issue #21), in parts (PARTS, default "tests profile"):
#   tests    GPU test files (TESTS, default: the data-plane ops', the fused kernels' against
#            their torch references, then the engine's: lossless HiSparse vs all-GPU, CUDA
#            graphs, on the fused path);
#   profile  the 128K decode step profiled per variant (VARIANTS, default the torch
#            compositions, HISPARSE_FUSED=reference, and the fused kernels), both placements, the
#            model's own indexer (no replayed top-k), one checkpoint for both; per ASYNC
#            (default "on"; "off on": the synchronous engine beside it, profile_<v>_sync);
#   topk     the indexer's top-k select against torch.topk (benchmarks/bench_topk.py, TOPK_ARGS; with
#            TOPK_BASELINE=FILE also another version's select, a module file, beside it);
#   indexer  the indexer's score stage and its config sweep (benchmarks/bench_indexer.py, INDEXER_ARGS; with
#            INDEXER_BASELINE=FILE also another version's score stage beside it);
#   mla      the sparse MLA decode kernel (benchmarks/bench_sparse_mla.py, MLA_ARGS, default
#            "--splits 2 --batches 1,8,29,64"; with MLA_BASELINE=FILE another version's kernel
#            module beside it, alternating);
#   ttgir    every Triton kernel this call compiled, as TTGIR ($OUT/ttgir.tar.gz: which
#            loads the pipeliner staged, which ran synchronously in a loop), last;
#   smol_a   keep the first half of the SmolLM2 GGUF (.smol1/part0) on the machine;
#   smol     SmolLM2-135M (a GGUF at $SMOL_GGUF, else assembled from that half and
#            .smol2/part1) at batch 64 against transformers per variant
#            (benchmarks/bench_smollm2.py), then its full-batch decode step profiled;
#            with SMOL_BASE=DIR first another version's tree (the same bench, its own code);
#            with smol_prefill also the prefill of 8 prompts of 492 tokens profiled, the
#            batched torch path against the decode kernels' one row per token.
# Prints each part's summary last; details under $OUT.
#   OUT=/tmp/out PARTS="tests profile" bash benchmarks/gpu_fused_ops.sh
# The bundled GGUF (98 MB) is more than one device call carries (64 MiB): split it here
#   split -n 2 -d "$(python -c 'from hisparse.models.smollm2 import smollm2_gguf_path as p; print(p())')" /tmp/smolpart
#   mkdir -p .smol1 .smol2 && mv /tmp/smolpart00 .smol1/part0 && mv /tmp/smolpart01 .smol2/part1
#   printf '/.smol1/\n/.smol2/\n' >> .git/info/exclude
# then run one call carrying .smol1 with PARTS including smol_a and, while that machine is
# still warm (30 s), one carrying .smol2 and .whl (the gguf wheel) with PARTS=smol.
set -uo pipefail
OUT=${OUT:-/tmp/hisparse-fused}
PARTS=${PARTS:-tests profile}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
has() { [[ " $PARTS " == *" $1 "* ]]; }
# VARIANTS: the fused ops' backends (HISPARSE_FUSED) to run
VARIANTS=${VARIANTS:-reference triton}
TESTS=${TESTS:-test_ops_gpu test_fused_gpu test_engine_gpu}

if has smol_a; then
  mkdir -p /tmp/smolparts && cp .smol1/part0 /tmp/smolparts/ || echo "smol_a: no .smol1/part0"
fi
if has smol; then  # the GGUF first: the SmolLM2 GPU tests read it too (SMOLLM2_GGUF)
  GGUF=${SMOL_GGUF:-/tmp/smol.gguf}
  if [ ! -f "$GGUF" ] && [ -f /tmp/smolparts/part0 ] && [ -f .smol2/part1 ]; then
    cat /tmp/smolparts/part0 .smol2/part1 >"$GGUF"
  fi
  [ -f "$GGUF" ] && export SMOLLM2_GGUF=$GGUF
  if ! $PY -c "import gguf" 2>/dev/null && ls .whl/gguf-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/gguf-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
fi
if has tests; then
  for t in $TESTS; do  # each file under its own limit; -x: the first failure is the one to see
    timeout "${TEST_LIMIT_S:-240}" $PY -m pytest -o addopts="" -q -x --tb=short \
      -p no:cacheprovider "tests/gpu/$t.py" >"$OUT/$t.txt" 2>&1 || echo "$t: rc $?"
  done
fi
if has profile; then
  CKPT=${CKPT:-/tmp/v32p}
  [ -f "$CKPT/config.json" ] || $PY -c "from hisparse.models.tiny import make_tiny; \
make_tiny('deepseek_v32', '$CKPT', preset='v32-attention', num_hidden_layers=4)" \
    >"$OUT/make_tiny.txt" 2>&1
  P="--model $CKPT --layers 4 --context 131072 --batches 1,29 --paths graphs --output 20"
  P="$P --skip 4 --active 3 --gpu-memory-gib 14 --overlap 0 --top-kernels 70"
  for v in $VARIANTS; do
    for a in ${ASYNC:-on}; do
      n=profile_$v; [ "$a" = off ] && n=${n}_sync
      HISPARSE_FUSED=$v timeout 170 $PY benchmarks/profile_decode.py $P --async-scheduling "$a" \
        --out "$OUT/$n" >"$OUT/$n.txt" 2>&1 || echo "profile $v async $a: rc $?"
    done
  done
fi
if has topk; then
  timeout 300 $PY benchmarks/bench_topk.py ${TOPK_BASELINE:+--baseline "$TOPK_BASELINE"} ${TOPK_ARGS:-} \
    >"$OUT/bench_topk.txt" 2>&1 || echo "topk: rc $?"
fi
if has indexer; then
  timeout 300 $PY benchmarks/bench_indexer.py ${INDEXER_BASELINE:+--baseline "$INDEXER_BASELINE"} ${INDEXER_ARGS:-} \
    >"$OUT/bench_indexer.txt" 2>&1 || echo "indexer: rc $?"
fi
if has mla; then
  timeout 300 $PY benchmarks/bench_sparse_mla.py ${MLA_ARGS:---splits 2 --batches 1,8,29,64} \
    ${MLA_BASELINE:+--baseline "$MLA_BASELINE"} >"$OUT/bench_sparse_mla.txt" 2>&1 || echo "mla: rc $?"
fi
if has smol; then
  if [ -f "$GGUF" ] && has smol_prefill; then  # where a batch's prefill time goes: the
    # batched torch path (the attention and indexer references) against one decode-kernel
    # row per token
    for route in batched rows; do
      ref=(); [ $route = batched ] && ref=(HISPARSE_ATTENTION=reference HISPARSE_GQA_INDEXER=reference)
      env ${ref[@]+"${ref[@]}"} timeout 200 $PY benchmarks/profile_prefill.py --model "$GGUF" \
        --input-len 492 --prompts 8 --max-batched-tokens 4096 --placements hisparse \
        --out "$OUT/smol_prefill_$route" >"$OUT/smol_prefill_$route.txt" 2>&1 \
        || echo "smol prefill $route: rc $?"
    done
  fi
  if [ -f "$GGUF" ] && [ -n "${SMOL_BASE:-}" ]; then  # another version's tree (src/, benchmarks/),
    # e.g. the code the issue started from: `git archive REV src benchmarks | tar -x -C .base`
    PYTHONPATH=$SMOL_BASE/src${PYTHONPATH#src} timeout 150 $PY "$SMOL_BASE/benchmarks/bench_smollm2.py" \
      --device cuda --batch 64 --max-tokens 64 --top-k 256 --model "$GGUF" \
      --out "$OUT/smol_base" >"$OUT/smol_base.txt" 2>&1 || echo "smol base: rc $?"
  fi
  if [ -f "$GGUF" ]; then
    for v in $VARIANTS; do
      export HISPARSE_FUSED=$v
      for a in ${ASYNC:-on}; do  # ASYNC="off on": the synchronous engine beside it (_sync)
        n=${v}; [ "$a" = off ] && n=${n}_sync
        timeout 150 $PY benchmarks/bench_smollm2.py --device cuda --batch 64 \
          --max-tokens 64 --top-k 256 --model "$GGUF" --async-scheduling "$a" \
          --out "$OUT/smol_$n" >"$OUT/smol_$n.txt" 2>&1 || echo "smol $n: rc $?"
        timeout 150 $PY benchmarks/profile_decode.py --model "$GGUF" --layers 30 \
          --context 492 --batches 64 --output 14 --skip 4 --active 3 --paths graphs \
          --placements hisparse --top-k 256 --top-kernels 60 --async-scheduling "$a" \
          --out "$OUT/smolprof_$n" >"$OUT/smolprof_$n.txt" 2>&1 || echo "smol profile $n: rc $?"
      done
    done
    unset HISPARSE_FUSED
  else
    echo "smol: no GGUF at $GGUF"
  fi
fi

if has ttgir; then
  find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name "*.ttgir" -print0 2>/dev/null \
    | tar -czf "$OUT/ttgir.tar.gz" --null -T - 2>/dev/null || echo "ttgir: none"
fi

if has tests; then
  for t in $TESTS; do tail -n 3 "$OUT/$t.txt"; done
fi
if has mla && [ -f "$OUT/bench_sparse_mla.txt" ]; then
  echo "== mla"; tail -n 12 "$OUT/bench_sparse_mla.txt"
fi
if has profile; then
  for v in $VARIANTS; do
    for a in ${ASYNC:-on}; do
      n=profile_$v; [ "$a" = off ] && n=${n}_sync
      echo "== $n"; grep "^| \|same tokens" "$OUT/$n.txt"
    done
  done
fi
if has topk && [ -f "$OUT/bench_topk.txt" ]; then
  echo "== topk"; sed -n '/^HBM copy/,$p' "$OUT/bench_topk.txt"
fi
if has indexer && [ -f "$OUT/bench_indexer.txt" ]; then
  echo "== indexer"; sed -n '/^score stage, --baseline/,$p' "$OUT/bench_indexer.txt"
fi
if has smol && has smol_prefill; then
  for route in batched rows; do
    [ -f "$OUT/smol_prefill_$route.txt" ] && { echo "== smol prefill $route"; grep "wall" "$OUT/smol_prefill_$route.txt"; }
  done
fi
if has smol; then
  [ -f "$OUT/smol_base.txt" ] && { echo "== smol base ($SMOL_BASE)"; grep "^| \|tok/s" "$OUT/smol_base.txt" | tail -6; }
  for v in $VARIANTS; do
    for a in ${ASYNC:-on}; do
      n=${v}; [ "$a" = off ] && n=${n}_sync
      [ -f "$OUT/smol_$n.txt" ] && { echo "== smol $n"; grep "^| \|tok/s" "$OUT/smol_$n.txt" | tail -6; }
      [ -f "$OUT/smolprof_$n.txt" ] && grep "^| " "$OUT/smolprof_$n.txt"
    done
  done
fi
exit 0
