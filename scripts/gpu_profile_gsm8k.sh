#!/usr/bin/env bash
# Where a GSM8K-shaped generation's GPU time goes (issue 28's lm-eval target): 1,319 prompts
# of 925 tokens sharing their first 878 (the 8-shot prompt), 256 new tokens each, 256 rows,
# under model_profile.throughput_profile. One GPU, <= 200 s by the step limit.
# $OUT receives profile_gsm8k.tar.gz (profile_gsm8k/: log.txt, shared/).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
[ $# -ge 1 ] && lane "$1"
use_wheels
stage profile_gsm8k
P="python3 -m model_profile.throughput_profile --preset 7B --prompts 1319 --input-len 925 --output-len 256 --max-batch 256 --top 30"
step profile_gsm8k_shared 200 $P --shared-prefix 878 --out "$STAGE/shared"
grep -E "^===|rror" "$LOG" | tail -8
for d in shared; do head -c 7000 "$STAGE/$d/kernels.md" 2>/dev/null; cat "$STAGE/$d/summary.json" 2>/dev/null; done
echo "profile_gsm8k status=$status" | tee -a "$LOG"
tar czf "$OUT/profile_gsm8k.tar.gz" -C "$(dirname "$STAGE")" profile_gsm8k
exit $status
