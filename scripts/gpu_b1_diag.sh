#!/usr/bin/env bash
# Batch-1 decoding kernel by kernel with programmatic dependent launch off (NAKTA_PDL=0: each
# kernel's duration is its own, not its wait for the one before), bf16 and FP8; then the
# batch-1 FP8 tuner again (the RMSNorm prologue changed) and decode_speed at batch 1 with its
# rows. One GPU, <= 420 s by the step limits. $OUT receives b1_diag.tar.gz.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
[ $# -ge 1 ] && lane "$1"
use_wheels
stage b1_diag
JOBS=$(tuner_jobs)
P="python3 -m model_profile.throughput_profile --preset 7B --prompts 1 --input-len 64 --output-len 128 --max-batch 1 --top 14"
step prof_bf16_nopdl 90 env NAKTA_PDL=0 $P --out "$STAGE/bf16_nopdl"
step prof_fp8_nopdl 90 env NAKTA_PDL=0 $P --quant fp8 --out "$STAGE/fp8_nopdl"
step tune_fp8_decode_b1 120 python3 -m kernel_benchmark.tune_fp8_decode --batches 1 \
  --budget 100 --jobs "$JOBS" --out "$STAGE/tune_b1"
cp nakta_model/kernels/_decode_linear_fp8_tuned.json "$STAGE/"
step decode_b1 80 python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 \
  --batches 1 --lengths 64:128 --no-budget --out "$STAGE/decode"
grep -E "^===|rror" "$LOG" | tail -10
for d in bf16_nopdl fp8_nopdl; do head -c 3500 "$STAGE/$d/kernels.md"; echo; done
cut -c1-200 "$STAGE/decode/decode.md" 2>/dev/null | tail -4
echo "b1_diag status=$status" | tee -a "$LOG"
tar czf "$OUT/b1_diag.tar.gz" -C "$(dirname "$STAGE")" b1_diag
exit $status
