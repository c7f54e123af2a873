#!/usr/bin/env bash
# Issue 27 on one H100 (nvidia-h100-x1): the batch-1 FP8 GEMV tuner with PREFETCH in its grid,
# fp8_decode_gemm tuned for the H100 family (8-64 rows), then decode_speed bf16 vs FP8 at
# batch 1 / 8 / 32 in a fresh process that loads both tables. <= 540 s by the step limits.
# $OUT receives h100_fp8.tar.gz (h100_fp8/: log.txt, both tuned JSONs, tune_b1/, gemm_tune/,
# fp8_decode/).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
stage h100_fp8
mkdir -p "$STAGE/gemm_tune"
JOBS=$(tuner_jobs)
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-120 | tee -a "$LOG"
SLUG=$(python3 -c "from bench_common.ceilings import device_slug; print(device_slug())")
step fp8_prefetch_gpu_tests 80 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
  tests/test_decode_linear_fp8_prefetch.py
step tune_fp8_decode_b1 150 python3 -m kernel_benchmark.tune_fp8_decode --batches 1 \
  --budget 135 --jobs "$JOBS" --out "$STAGE/tune_b1"
step tune_fp8_decode_gemm 150 python3 -m kernel_benchmark.tune_fp8_decode_gemm --budget 120
cp kernel_benchmark/results/"$SLUG"/fp8_decode_gemm_tune* "$STAGE/gemm_tune/" 2>/dev/null
cp nakta_model/kernels/_decode_linear_fp8_tuned.json nakta_model/kernels/_fp8_decode_gemm_tuned.json "$STAGE/"
step decode_e2e 100 python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 \
  --batches 1,8,32 --lengths 64:128 --no-budget --out "$STAGE/fp8_decode"
prefetch_best "$STAGE/tune_b1/fp8_decode_tune.csv" 2>&1 | tee -a "$LOG"
grep -v -E "it/s\]|s/it\]|%\|" "$LOG" | grep -E "^===|precompile|budget|tuned|passed|failed|rror" |
  cut -c1-220 | tail -30
cut -c1-250 "$STAGE/fp8_decode/decode.md" 2>/dev/null | tail -10
echo "h100_fp8 status=$status" | tee -a "$LOG"
tar czf "$OUT/h100_fp8.tar.gz" -C "$(dirname "$STAGE")" h100_fp8
exit $status
