#!/usr/bin/env bash
# Where generation's GPU time goes (model_profile.throughput_profile), one GPU, <= 420 s by the
# step limits: the 1,000 x 128/128 throughput run at 256 rows (issue 28), and batch 1 (prompt
# 64, 128 new) in bf16 and FP8 (issues 28 and 27), kernel by kernel.
# $OUT receives profile_gen.tar.gz (profile_gen/: log.txt, throughput/, b1_bf16/, b1_fp8/).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
[ $# -ge 1 ] && lane "$1"
use_wheels
stage profile_gen
P="python3 -m model_profile.throughput_profile --preset 7B"
step profile_throughput 180 $P --prompts 1000 --max-batch 256 --out "$STAGE/throughput"
step profile_b1_bf16 100 $P --prompts 1 --input-len 64 --output-len 128 --max-batch 1 \
  --out "$STAGE/b1_bf16"
step profile_b1_fp8 100 $P --prompts 1 --input-len 64 --output-len 128 --max-batch 1 \
  --quant fp8 --out "$STAGE/b1_fp8"
grep -E "^===|rror" "$LOG" | tail -12
for d in throughput b1_bf16 b1_fp8; do head -c 6000 "$STAGE/$d/kernels.md" 2>/dev/null; done
echo "profile_gen status=$status" | tee -a "$LOG"
tar czf "$OUT/profile_gen.tar.gz" -C "$(dirname "$STAGE")" profile_gen
exit $status
