#!/usr/bin/env bash
# What a machine's first run compiles, one GPU, <= 450 s by the step limits: random 7B bf16,
# model_profile.compile_profile (the scorer's warm-up and a GSM8K-shaped first generation) on
# an empty Triton cache and again on the cache that run filled; then lm-eval's GSM8K-full as a
# first run (nakta, its own empty cache) with every compile of its processes logged
# (scripts/compile_log/sitecustomize.py). Needs .data/ and .whl/ carried.
# $OUT receives first_run.tar.gz.
# Usage: bash scripts/gpu_first_run.sh [LANE]
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
[ $# -ge 1 ] && lane "$1"
use_wheels
stage first_run
export TRITON_CACHE_DIR=$STAGE/triton_cache  # empty: this run fills it, the second reads it
step compile_empty 180 python3 -m model_profile.compile_profile --keep-cache --out "$STAGE/empty"
step compile_warm 120 python3 -m model_profile.compile_profile --keep-cache --out "$STAGE/warm"
export TRITON_CACHE_DIR=$STAGE/triton_cache_gsm8k NAKTA_COMPILE_LOG=$STAGE/gsm8k_compiles.csv
PYTHONPATH=$PWD/scripts/compile_log:$PYTHONPATH step gsm8k_first 150 \
  python3 speed_bench/lm_eval_gsm8k.py --preset 7B --models nakta \
  --tokenizer .data/llama_tokenizer.model --run-timeout-s 120 --out "$STAGE/gsm8k_first" \
  --work /tmp/first_run_gsm8k
unset NAKTA_COMPILE_LOG
rm -rf "$STAGE"/triton_cache*
python3 - "$STAGE/gsm8k_compiles.csv" <<'PY' 2>&1 | tee -a "$LOG"
import sys
import pandas as pd
df = pd.read_csv(sys.argv[1])
print(f"gsm8k first run: {len(df)} compiles, {df.seconds.sum():.1f} s")
g = df.groupby(["kernel", "specialization"]).seconds.agg(["count", "sum"]).reset_index()
print(g.sort_values("sum", ascending=False).to_string(max_colwidth=150))
PY
grep -E "^===|rror" "$LOG" | tail -8
for d in empty warm; do head -c 4000 "$STAGE/$d/compile.md" 2>/dev/null; done
echo "first_run status=$status" | tee -a "$LOG"
tar czf "$OUT/first_run.tar.gz" -C "$(dirname "$STAGE")" first_run
exit $status
