#!/usr/bin/env bash
# What a machine's first run compiles (model_profile.compile_profile), one GPU, <= 300 s by the
# step limits: random 7B bf16, the scorer's warm-up and a GSM8K-shaped first generation, on an
# empty Triton cache and again on the cache that run filled. $OUT receives first_run.tar.gz.
# Usage: bash scripts/gpu_first_run.sh [LANE]
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
[ $# -ge 1 ] && lane "$1"
use_wheels
STAGE=$(mktemp -d /tmp/first_run.XXXXXX)/first_run
mkdir -p "$STAGE"
LOG=$STAGE/log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
export TRITON_CACHE_DIR=$STAGE/triton_cache  # empty: this run fills it, the second reads it
step compile_empty 180 python3 -m model_profile.compile_profile --keep-cache --out "$STAGE/empty"
step compile_warm 120 python3 -m model_profile.compile_profile --keep-cache --out "$STAGE/warm"
rm -rf "$TRITON_CACHE_DIR"
grep -E "^===|rror" "$LOG" | tail -8
for d in empty warm; do head -c 4000 "$STAGE/$d/compile.md" 2>/dev/null; done
echo "first_run status=$status" | tee -a "$LOG"
tar czf "$OUT/first_run.tar.gz" -C "$(dirname "$STAGE")" first_run
exit $status
