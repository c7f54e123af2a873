#!/usr/bin/env bash
# Issue 26 GPU job (nvidia-h100-x2, one device call, ~10 min): lm-eval through Nakta on 1 GPU vs
# `torchrun --nproc_per_node 2 ... dp=2`, every run a fresh process through the CLI
# (python -m accuracy_test.lm_eval_cli), on a random LLaMA-7B (bf16, made with transformers and
# converted by convert.py), task hellaswag_local on the full validation jsonl:
#   1. 10-shot, 2,000 tasks: 1 GPU, then dp=2          target: dp wall <= 0.6x the 1-GPU wall
#   2. 0-shot, all 10,042 tasks: 1 GPU, then dp=2       target: <= 0.7x; fixed part <= 1 GPU + 2 s
#   3. the suite hellaswag_local,mmlu_shaped_local,gsm8k_shaped_local,bbh_shaped_local in ONE
#      lm-eval call vs one call per task (--limit 20 per task), nakta; and hf (--batch_size
#      auto) in one call
# in that order of importance: a run that could not finish before the driver's deadline is not
# started (listed as skipped), so the call ends in time whatever is slow.
#
# Run from the repo root with `.data/` (copy of shared/data) and `.whl/` (lm-eval etc.) carried:
#   bash scripts/gpu_dp.sh
# $OUT receives: lm_eval_dp/lm_eval_dp_summary.{json,md,png}, lm_eval_dp/lm_eval_dp_ranks.json
# (per-rank phases, suite runs), lm_eval_dp/logs/ (every child's log), log.txt.
#   -> commit lm_eval_dp/ (without logs/) as speed_bench/results/<device>/lm_eval_dp/
# CPU smoke test of this script (tiny Nakta checkpoint, gloo, 2 processes):
#   DP_SMOKE=/path/to/nakta_ckpt OUT=/tmp/x bash scripts/gpu_dp.sh
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
mkdir -p "$OUT"
LOG=$OUT/log.txt
: >"$LOG"
status=0
DATA=.data
[ -d "$DATA" ] || DATA=../shared/data
R=$OUT/lm_eval_dp
if [ -n "${DP_SMOKE:-}" ]; then  # CPU: the same driver, tiny model, small limits
  export OMP_NUM_THREADS=1
  step lm_eval_dp 400 python3 speed_bench/lm_eval_dp.py --checkpoint "$DP_SMOKE" --device cpu \
    --data "$DATA/hellaswag_val_full.jsonl" --runs 10:8,0:40 --gpus 2 \
    --suite hellaswag_local,gsm8k_shaped_local --suite-limit 2 --warmup-limit 4 \
    --run-timeout-s 120 --deadline-s 380 --out "$R" --work /tmp/lm_eval_dp_work
else
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee -a "$LOG"
  # 575 s: weights (~2 min) + warm-up + 6 timed runs + the suite (nakta one call and one by
  # one, hf at --batch_size auto in one call); the driver starts no run that could not end
  # (150 s each at most) before its own 555 s deadline
  step lm_eval_dp 575 python3 speed_bench/lm_eval_dp.py --preset 7B \
    --tokenizer "$DATA/llama_tokenizer.model" --data "$DATA/hellaswag_val_full.jsonl" \
    --runs 10:2000,0:all --gpus 2 --launchers nakta,torchrun --suite-limit 20 --warmup-limit 32 \
    --suite-hf --suite-hf-modes one_call --hf-batch-size auto \
    --run-timeout-s 150 --deadline-s 555 --out "$R" --work /tmp/lm_eval_dp_work
fi
grep -v -E "it/s\]|s/it\]|tok/s\]" "$LOG" | cut -c1-220 | tail -60
exit $status
