#!/usr/bin/env bash
# Issue 28 item 5 GPU job (one H100, one device call, <= 420 s): lm-eval generate_until on the
# full GSM8K-shaped task (gsm8k_shaped_full_local: 1,319 docs, 8-shot, up to 256 new tokens,
# stops at "Question:"), every run a fresh process through the CLI
# (python -m accuracy_test.lm_eval_cli), on a random LLaMA-7B (bf16, made with transformers and
# converted by convert.py, ~1 min), in this order:
#   1. --model nakta as a user runs it (no --batch_size), all 1,319 docs
#   2. --model hf --batch_size 64 (the cap of lm-eval's auto) on the first 256 docs (4 whole
#      batches; all 1,319 would take ~8 min), its wall on all docs extrapolated in a column of
#      its own (fixed part + generation scaled linearly: a lower bound for hf)
#   3. nakta on the same 256 docs (a measured ratio on the same docs)
# Target: nakta >= 6x hf in wall clock on all 1,319 docs. A run that could not end before the
# driver's deadline (390 s after its start) is not started and is listed as skipped; the
# results are rewritten after every run, so a cut step keeps the runs it finished.
#
# Run from the repo root with `.data/` (copy of shared/data: llama_tokenizer.model) and `.whl/`
# (lm-eval 0.4.13 and its deps) carried:
#   bash scripts/gpu_gsm8k.sh
# $OUT receives: lm_eval_gsm8k_full/lm_eval_summary.{json,md,png}, lm_eval_gsm8k_full/logs/
# (every child's log and convert.log), log.txt.
#   -> commit lm_eval_gsm8k_full/ (without logs/) as speed_bench/results/<device>/lm_eval_gsm8k_full/
# CPU smoke test of this script (tiny random model, 3 docs, 8 new tokens, ~1 min):
#   GSM8K_SMOKE=1 OUT=/tmp/x bash scripts/gpu_gsm8k.sh
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
R=$OUT/lm_eval_gsm8k_full
rm -rf /tmp/gsm8k_work /tmp/gsm8k_smoke_work  # a warm machine's earlier weights: made afresh
if [ -n "${GSM8K_SMOKE:-}" ]; then  # CPU: the same driver, tiny random model, tiny limits
  step lm_eval_gsm8k 300 python3 speed_bench/lm_eval_gsm8k.py --preset tiny --device cpu \
    --tokenizer "$DATA/stories260K/tokenizer.model" --limit 3 --max-gen-toks 8 \
    --hf-batch-sizes 2 --hf-limit 2 --nakta-on-hf-docs --run-timeout-s 120 --hf-timeout-s 120 \
    --subset-timeout-s 60 --deadline-s 280 --out "$R" \
    --work /tmp/gsm8k_smoke_work
else
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
  # 400 s: weights (~70 s) + nakta on 1,319 docs (~100 s) + hf on 256 (~120 s) + nakta on 256
  # (~30 s); no run starts that could not end (by its own limit) before the 390 s deadline
  step lm_eval_gsm8k 400 python3 speed_bench/lm_eval_gsm8k.py --preset 7B \
    --tokenizer "$DATA/llama_tokenizer.model" --hf-batch-sizes 64 --hf-limit 256 \
    --nakta-on-hf-docs --run-timeout-s 180 --hf-timeout-s 180 --subset-timeout-s 75 \
    --deadline-s 390 --out "$R" --work /tmp/gsm8k_work
fi
grep -v -E "it/s\]|s/it\]|tok/s\]" "$LOG" | cut -c1-220 | tail -40
cat "$R/lm_eval_summary.md" 2>/dev/null
exit $status
