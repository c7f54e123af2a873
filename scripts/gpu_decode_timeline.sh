#!/usr/bin/env bash
# Batch-1 decode steps kernel by kernel in the chain (model_profile.decode_timeline): random 7B
# FP8 and bf16, prompt 64, 64 new tokens under torch.profiler, each in a fresh process, plus
# any extra NAME=ENV settings given (each its own FP8 process). One GPU, <= 300 s.
# $OUT receives decode_timeline.tar.gz (log.txt, one folder a run).
# Usage: bash scripts/gpu_decode_timeline.sh [NAME=VAR=VALUE ...]
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
stage decode_timeline
T="python3 -m model_profile.decode_timeline --preset 7B --prompt 64 --gen 64 --dump"
step fp8 120 $T --quant fp8 --out "$STAGE/fp8"
step bf16 120 $T --out "$STAGE/bf16"
for spec in "$@"; do
  name=${spec%%=*} setting=${spec#*=}
  step "$name" 120 env "$setting" $T --quant fp8 --out "$STAGE/$name"
done
grep -vE "^\s*$" "$LOG" | grep -E "^===|kind|wqkv|attention|wo |w13|w2 |tail|Step" | tail -40
echo "decode_timeline status=$status" | tee -a "$LOG"
tar czf "$OUT/decode_timeline.tar.gz" -C "$(dirname "$STAGE")" decode_timeline
exit $status
