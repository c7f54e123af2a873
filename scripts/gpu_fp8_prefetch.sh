#!/usr/bin/env bash
# Issue 27, bytes in flight for the batch-1 FP8 decode GEMVs: the PREFETCH launch knob
# (_decode_linear_kernels._fma_prefetch_loop: the next K tile's weight words loaded before the
# current tile's FMAs) timed against PREFETCH=0 on this GPU: <= 300 s by the step limits
# (~4 min expected), one GPU. Steps:
#   1. GPU tests: PREFETCH=1 equals PREFETCH=0 bit for bit at the 7B shapes, batch 1, on the
#      three H200-tuned tiles (the inline-asm unpacking and the layouts compiled for this GPU;
#      the whole grid's layouts are checked on the CPU: sass_loop_counts --grid), and under
#      CUDA-graph replay (tests/test_decode_linear_fp8_prefetch.py -m gpu);
#   2. the tuner at batch 1 with PREFETCH in its grid (budget 135 s, killed at 150 s): it
#      writes this GPU family's batch-1 rows, PREFETCH included, into
#      nakta_model/kernels/_decode_linear_fp8_tuned.json (other rows kept);
#   3. decode_speed 7B nakta / nakta_fp8 at batch 1 (prompt 64, 128 new) in a fresh process,
#      so with the rows step 2 wrote.
# Usage (repo root; .whl/ carried when present, no data needed):
#   bash scripts/gpu_fp8_prefetch.sh        one GPU (nvidia-h200 / nvidia-h100-x1)
#   bash scripts/gpu_fp8_prefetch.sh N      as lane N of a multi-GPU host (gpu_env.sh `lane`:
#                                           GPU N, its share of the cores), beside other jobs
# $OUT receives one file, fp8_prefetch.tar.gz, holding fp8_prefetch/:
#   log.txt                          the full log (step limits, rc, every tuner line)
#   _decode_linear_fp8_tuned.json    the tuned rows with PREFETCH: copy to nakta_model/kernels/
#   tune/                            fp8_decode_tune.{csv,md,json}: every timing, best per shape
#   decode/                          decode_speed (decode.{csv,md,json}, plot)
# and the summary on stdout.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
[ $# -ge 1 ] && lane "$1"
use_wheels
export PYTHONUNBUFFERED=1
stage fp8_prefetch
JOBS=$(tuner_jobs)
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-120 | tee -a "$LOG"
TUNED=nakta_model/kernels/_decode_linear_fp8_tuned.json
step fp8_prefetch_gpu_tests 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
  tests/test_decode_linear_fp8_prefetch.py
step tune_fp8_decode_b1 150 python3 -m kernel_benchmark.tune_fp8_decode --batches 1 \
  --budget 135 --jobs "$JOBS" --out "$STAGE/tune"
step decode_speed_b1 60 python3 -m speed_bench.decode_speed --preset 7B \
  --engines nakta,nakta_fp8 --batches 1 --lengths 64:128 --no-budget --out "$STAGE/decode"
[ -f "$TUNED" ] && cp "$TUNED" "$STAGE/"
grep -v -E "it/s\]|s/it\]|%\|" "$LOG" | grep -E "^===|^\[|precompile|budget|tuned configs|passed|failed|rror" |
  cut -c1-240 | tail -40
prefetch_best "$STAGE/tune/fp8_decode_tune.csv" 2>&1 | tee -a "$LOG"
cat "$STAGE/decode/decode.md" 2>/dev/null | cut -c1-250 | tail -12
echo "fp8_prefetch status=$status" | tee -a "$LOG"
tar czf "$OUT/fp8_prefetch.tar.gz" -C "$(dirname "$STAGE")" fp8_prefetch
exit $status
