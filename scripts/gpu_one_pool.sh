#!/usr/bin/env bash
# Issue 28 item 1 GPU check (one GPU, <= 4 min with the weights): one KV pool for the scorer and
# the generation engine, capped while scoring. lm-eval through the CLI
# (python -m accuracy_test.lm_eval_cli, every run a fresh process, --limit 40) on a random
# LLaMA-7B (bf16, drawn on the GPU and written as a Nakta checkpoint, ~30 s; kept in the work
# folder for a later run on a warm machine):
#   1. ONE call: gsm8k_shaped_local (generate_until, 8-shot), hellaswag_local and
#      mmlu_shaped_local (loglikelihood, 0- and 5-shot): the engine's pool (~80% of the free
#      memory) is trimmed when scoring starts;
#   2. each task alone, to check the metrics are equal and compare the answers doc by doc.
# Wall and the CUDA allocator's peaks (run and per request method, with what each method left
# allocated) come from the CLI's timing hook (cuda_memory).
#
# Run from the repo root with .data/ (llama_tokenizer.model, hellaswag_val_full.jsonl) and .whl/
# (lm-eval and its deps) carried:
#   bash scripts/gpu_one_pool.sh
# Under a lane of a 2-GPU session: ONE_POOL_LANE=1 bash scripts/gpu_one_pool.sh (GPU 1, half the
# cores, log $OUT/lane1.txt), or source this file and call one_pool inside your own lane.
# $OUT receives one_pool/one_pool_summary.{json,md}, one_pool/logs/ (each child's log), the log.
#   -> commit one_pool/ (without logs/) as speed_bench/results/<device>/lm_eval_one_pool/
# CPU smoke test of this script (tiny random model, 3 docs a task, 8 new tokens; ~3 min on 2
# busy cores, most of it MMLU-shaped's 57 subtasks):
#   ONE_POOL_SMOKE=1 OUT=/tmp/x bash scripts/gpu_one_pool.sh
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

one_pool() {  # the check, in the calling shell (a lane's GPU, cores and LOG when set)
  local data=.data res=$OUT/one_pool work=/tmp/one_pool_work${CUDA_VISIBLE_DEVICES:+_$CUDA_VISIBLE_DEVICES}
  [ -d "$data" ] || data=../shared/data
  mkdir -p "$res"
  if [ -n "${ONE_POOL_SMOKE:-}" ]; then  # CPU: the same driver, tiny random model, tiny limits
    step one_pool 300 python3 speed_bench/lm_eval_one_pool.py --preset tiny --device cpu \
      --tokenizer "$data/stories260K/tokenizer.model" --data "$data/hellaswag_val_full.jsonl" \
      --limit 3 --max-gen-toks 8 --max-seq-len 512 --run-timeout-s 120 \
      --work "$work"_smoke --out "$res"
  else
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 | tee -a "$LOG"
    # 235 s: weights (~30 s) + the one call (~70 s) + three calls alone (~40 s each); each
    # child at most 80 s, and the summary is rewritten after every run (a cut step keeps them)
    step one_pool 235 python3 speed_bench/lm_eval_one_pool.py --preset 7B \
      --tokenizer "$data/llama_tokenizer.model" --data "$data/hellaswag_val_full.jsonl" \
      --limit 40 --run-timeout-s 80 --work "$work" --out "$res"
  fi
  cat "$res/one_pool_summary.md" 2>/dev/null | cut -c1-250
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run (not sourced)
  use_wheels
  mkdir -p "$OUT"
  status=0
  if [ -n "${ONE_POOL_LANE:-}" ]; then
    lane "$ONE_POOL_LANE"
  else
    LOG=$OUT/log.txt
    : >"$LOG"
  fi
  one_pool
  grep -v -E "it/s\]|s/it\]|tok/s\]" "$LOG" | cut -c1-220 | tail -30
  exit $status
fi
