#!/usr/bin/env bash
# One H200 (or whatever one-GPU machine comes), after the batch-1 dependent-launch changes:
# decode_speed 7B bf16 and FP8 at batch 1 with EARLY_W and the attention trigger off / on /
# off / on (fresh processes; the "on" runs at the defaults, the first also at 8 and 32 rows),
# then the throughput run (1,000 x 128/128, nakta at 256 rows). <= 480 s by the step limits.
# $OUT receives h200_final.tar.gz.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
stage h200_final
D="python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 --lengths 64:128 --no-budget"
OFF="env NAKTA_EARLY_WEIGHT=0 NAKTA_ATTENTION_TRIGGER=0"
step decode_off1 100 $OFF $D --batches 1 --out "$STAGE/off1"
step decode_on1 120 $D --batches 1,8,32 --out "$STAGE/on1"
step decode_off2 80 $OFF $D --batches 1 --out "$STAGE/off2"
step decode_on2 80 $D --batches 1 --out "$STAGE/on2"
step throughput 150 python3 -m speed_bench.throughput --preset 7B --prompts 1000 \
  --input-len 128 --output-len 128 --engines nakta --max-batch 256 --out "$STAGE/throughput"
decode_runs "$STAGE" off1 on1 off2 on2 2>&1 | tee -a "$LOG"
grep -E "^===|rror" "$LOG" | tail -12
cut -c1-260 "$STAGE/throughput/throughput.md" 2>/dev/null | tail -4
echo "h200_final status=$status" | tee -a "$LOG"
tar czf "$OUT/h200_final.tar.gz" -C "$(dirname "$STAGE")" h200_final
exit $status
