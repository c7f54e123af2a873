#!/usr/bin/env bash
# Decode steps kernel by kernel in the chain (model_profile.decode_timeline): random 7B FP8 and
# bf16 at each of $BATCHES rows (default 1), prompt 64, 64 new tokens under torch.profiler, each
# in a fresh process, plus any extra NAME=ENV settings given (each its own FP8 batch-1 process,
# every kernel dumped). One GPU, <= 300 s at the default.
# $OUT receives decode_timeline.tar.gz (log.txt, one folder a run).
# Usage: bash scripts/gpu_decode_timeline.sh [NAME=VAR=VALUE ...]
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
stage decode_timeline
T="python3 -m model_profile.decode_timeline --preset 7B --prompt 64 --gen 64"
for b in ${BATCHES:-1}; do
  step "fp8_b$b" 120 $T --batch "$b" --quant fp8 --out "$STAGE/fp8_b$b"
  step "bf16_b$b" 120 $T --batch "$b" --out "$STAGE/bf16_b$b"
done
T="$T --dump"
for spec in "$@"; do
  name=${spec%%=*} setting=${spec#*=}
  step "$name" 120 env "$setting" $T --quant fp8 --out "$STAGE/$name"
done
grep -vE "^\s*$" "$LOG" | grep -E "^===|kind|wqkv|attention|wo |w13|w2 |other|tail|Step" | tail -80
echo "decode_timeline status=$status" | tee -a "$LOG"
tar czf "$OUT/decode_timeline.tar.gz" -C "$(dirname "$STAGE")" decode_timeline
exit $status
