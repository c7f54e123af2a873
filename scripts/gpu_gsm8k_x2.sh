#!/usr/bin/env bash
# Issue 28's lm-eval target: lane 0 nakta on gsm8k_shaped_full_local (all 1,319 docs, the
# machine's first run: Triton's cache empty, then warm), lane 1 hf --batch_size 128 (its best
# batch) on the same task, both through the CLI in fresh processes. On a 2-GPU host the lanes
# run at once, one GPU each (<= 340 s by the step limits); on one GPU (an H200: hf's batch 128
# needs its memory) one after the other, nakta alone on the machine for its first run (<= 580 s).
# Needs .data/ and .whl/ carried. $OUT receives gsm8k_first.tar.gz, gsm8k_warm.tar.gz and
# gsm8k_hf128.tar.gz (each run's summaries and logs, as it ends) and the lane logs.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
D=.data
R=/tmp/gsm8k_x2_stage/gsm8k_x2
keep() { tar czf "$OUT/gsm8k_$1.tar.gz" -C "$R" "$1" 2>/dev/null; }  # a run's files, as it ends
mkdir -p "$R"
# a warm machine keeps an earlier call's weights (64 GB of disk); cleared before the lanes
# start, not inside one (lane 0 would delete lane 1's folder on a 2-GPU host)
rm -rf /tmp/gsm8k_work*
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee "$R/gpus.txt"
lane0() {
  lane 0
  export TRITON_CACHE_DIR=/tmp/gsm8k_triton_cache  # empty for the first run, warm for the next
  rm -rf "$TRITON_CACHE_DIR"
  # every Triton compile of the first run logged (scripts/compile_log/sitecustomize.py)
  NAKTA_COMPILE_LOG=$R/first_compiles.csv PYTHONPATH=$PWD/scripts/compile_log:$PYTHONPATH \
    step gsm8k_nakta_first 150 python3 speed_bench/lm_eval_gsm8k.py --preset 7B --models nakta \
    --tokenizer "$D/llama_tokenizer.model" --run-timeout-s 120 --out "$R/first" \
    --work /tmp/gsm8k_work
  mv "$R/first_compiles.csv" "$R/first/compiles.csv" 2>/dev/null
  keep first
  step gsm8k_nakta_warm 90 python3 speed_bench/lm_eval_gsm8k.py \
    --checkpoint /tmp/gsm8k_work/nakta --tokenizer "$D/llama_tokenizer.model" --models nakta \
    --run-timeout-s 80 --out "$R/warm" --work /tmp/gsm8k_work_warm
  keep warm
}
lane1() {
  lane 1
  step gsm8k_hf128 340 python3 speed_bench/lm_eval_gsm8k.py --preset 7B --models hf \
    --tokenizer "$D/llama_tokenizer.model" --hf-batch-sizes 128 --hf-timeout-s 300 \
    --out "$R/hf128" --work /tmp/gsm8k_work_hf128
  keep hf128
}
status=0
run_lanes lane0 lane1
for d in first warm hf128; do cut -c1-250 "$R/$d/lm_eval_summary.md" 2>/dev/null | tail -8; done
